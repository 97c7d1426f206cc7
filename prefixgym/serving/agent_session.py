"""One rollout's chat calls: its call tree, its sampler, and OpenAI's answer to each.

A call (`RolloutSession.complete`):
  1) the request's model must be the rollout's (404 otherwise, and the rollout is marked
     failed: a program that calls another model is not training this one);
  2) its messages go to the tree, which continues the conversation of the reply they
     extend and renders only what is new (`prompting.call_tree`); a `tool_choice` of
     "required" or a function ends the prompt with the opening of a call in the model's
     syntax (`prompting.tool_choice`: prompt tokens, never trained; 400 where it cannot);
  3) one engine request samples its `n` choices from that prompt (the prefix cache serves
     what earlier calls computed); the run's temperature and reply length unless the
     program sets its own; a seed fixed by (rollout seed, call number) unless it sets one;
  4) each reply is recorded in the tree exactly as sampled, and answered in OpenAI's shape
     with vLLM's extras: `token_ids` (the sampled ids), `prompt_token_ids` (with a forced
     opening), logprobs, `cached_tokens`, tool calls parsed in the model's own syntax
     from forced + sampled text (a forced reply that still writes no call is answered as
     text, and counted: `CallTree.forced_misses`), reasoning apart as `reasoning_content`.
`n` is at most `MAX_N`. The chat format's end-of-turn ids go with every call that
names no stop strings, so a remote sampler (vLLM behind `--sampler-url`) stops where the
built-in engine does; a sampler that cannot be reached or fails answers 502.

Knows OpenAI's chat shapes, call trees and the sampling protocol; not HTTP routes or
servers (agent_gateway.py), envs, rewards or training.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from prefixgym.prompting.call_tree import (
    CallMessage,
    CallTree,
    Pending,
    call_messages,
    reply_message,
)
from prefixgym.prompting.tool_choice import ToolChoiceError, forced_opening
from prefixgym.protocols import SamplingClient
from prefixgym.serving.bodies import BodyError
from prefixgym.serving.chat import ChatRequest, logprobs_content, openai_tool_calls
from prefixgym.serving.protocol import APIError, describe_validation_error
from prefixgym.types import JSONObject, ModelInput, SampleResponse, SamplingParams, derived_seed

MAX_N = 64
log = logging.getLogger("prefixgym.serve")
RefusalT = TypeVar("RefusalT", bound=APIError | BodyError)


@dataclass
class SamplingDefaults:
    """What a call that does not say samples with: the run's settings."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class RolloutSession:
    """One rollout's calls: its tree, its sampler, its seed, and what went wrong."""

    tree: CallTree
    sampler: SamplingClient
    model: str
    seed: int
    defaults: SamplingDefaults
    errors: list[str] = field(default_factory=list)
    """One line per call this endpoint refused (a wrong model, a malformed request, one
    asking for what it cannot do)."""

    async def complete(self, req: ChatRequest) -> JSONObject:
        """Steps 1-4 for one chat request; APIError for one it refuses."""
        if req.model is not None and req.model != self.model:
            raise self.refuse(APIError(
                404, f"model {req.model!r} does not exist; this rollout trains {self.model!r}",
                "model", "not_found_error"))
        if req.n > MAX_N:
            raise self.refuse(APIError(400, f"n = {req.n} exceeds the limit of {MAX_N}", "n"))
        if req.tools and self.tree.syntax is None:
            raise self.refuse(APIError(400, "this model's chat template has no tool-call syntax "
                                            "prefixgym knows, so a request cannot have tools",
                                       "tools"))
        try:
            forced = forced_opening(req.tool_choice, req.tools or [], self.tree.syntax)
            messages = call_messages([m.for_template(raw_calls=True) for m in req.messages])
            pending = await run_in_threadpool(self.tree.begin, messages, req.tools or [],
                                              forced)
        except ToolChoiceError as e:
            raise self.refuse(APIError(400, str(e), "tool_choice")) from None
        except ValueError as e:
            raise self.refuse(APIError(400, str(e).splitlines()[0], "messages")) from None
        try:
            params = self.params(req, pending.call)
            response = await self.sampler.sample(ModelInput.from_ints(pending.prompt),
                                                 num_samples=req.n, sampling_params=params)
        except ValidationError as e:
            raise self.refuse(APIError(400, *describe_validation_error(e))) from None
        except ValueError as e:
            raise self.refuse(APIError(400, str(e).splitlines()[0])) from None
        except (ConnectionError, RuntimeError) as e:  # the sampler's server, or the engine
            message = f"the sampler failed: {_first_line(e)}"
            log.warning("%s", message)
            raise APIError(502, message, None, "upstream_error") from None
        return await run_in_threadpool(self.answer, req, pending, response)

    def refuse(self, error: RefusalT) -> RefusalT:
        """`error`, noted in `errors`."""
        self.errors.append(f"{error.status}: {error.message}")
        return error

    def params(self, req: ChatRequest, call: int) -> SamplingParams:
        given = req.model_fields_set
        d = self.defaults
        return SamplingParams(
            max_tokens=req.max_completion_tokens or req.max_tokens or d.max_tokens,
            temperature=req.temperature if "temperature" in given else d.temperature,
            top_p=req.top_p if "top_p" in given else d.top_p, top_k=req.top_k,
            stop=req.stop_strings, stop_token_ids=self.stop_token_ids(req),
            seed=req.seed if req.seed is not None else derived_seed(self.seed, call))

    def stop_token_ids(self, req: ChatRequest) -> list[int]:
        """The call's own, and the chat format's end-of-turn ids unless it names stop
        strings (some samplers, tinker's, stop at strings or at ids, never both)."""
        own = list(req.stop_token_ids or [])
        if req.stop_strings:
            return own
        return list(dict.fromkeys([*own, *self.tree.format.stop_token_ids]))

    def answer(self, req: ChatRequest, pending: Pending, response: SampleResponse) -> JSONObject:
        """Step 4: record each reply in the tree and answer in OpenAI's shape."""
        tokenizer = self.tree.tokenizer
        choices = []
        for i, seq in enumerate(response.sequences):
            reasoning: list[str | None] = [None]

            def message_of(text: str) -> CallMessage:
                cut = req.cut_at_stop(text, seq.stop_reason)
                msg, reasoning[0] = reply_message(cut, self.tree.syntax, req.reads_tool_calls)
                return msg

            info = {"weights_version": response.weights_version,
                    "usage": response.usage.model_dump() if i == 0 else None,
                    "shared_by": len(response.sequences)}
            msg = self.tree.add_reply(pending, seq.tokens, seq.logprobs, seq.stop_reason,
                                      message_of, info)
            calls = openai_tool_calls(msg.tool_calls, [
                f"call_{pending.call}_{i}_{k}" for k in range(len(msg.tool_calls))])
            message: JSONObject = {"role": "assistant",
                                   "content": msg.content or (None if calls else "")}
            if calls:
                message["tool_calls"] = calls
            if reasoning[0] is not None:
                message["reasoning_content"] = reasoning[0]
            choices.append({
                "index": i, "message": message, "token_ids": list(seq.tokens),
                "prompt_token_ids": pending.prompt if i == 0 else None,
                "finish_reason": "tool_calls" if calls else seq.stop_reason,
                "logprobs": logprobs_content(tokenizer, seq.tokens, seq.logprobs)})
        sampled = sum(len(s.tokens) for s in response.sequences)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": self.model, "choices": choices,
            "usage": {"prompt_tokens": len(pending.prompt), "completion_tokens": sampled,
                      "total_tokens": len(pending.prompt) + sampled,
                      "prompt_tokens_details": {
                          "cached_tokens": response.usage.prefill_cached_tokens}},
            "metadata": {"weight_version": response.weights_version}}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
