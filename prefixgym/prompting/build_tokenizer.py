"""Train the built-in byte-level BPE tokenizer and write it to a directory.

    python -m prefixgym.prompting.build_tokenizer [OUT_DIR]   (default: prompting/assets)

The training corpus is generated here, deterministically, from word lists and
templates: English prose, small agent dialogues (guess a number, a calculator tool,
Wordle and Mastermind feedback, grid mazes, key-value lookups with
`<tool_call>` blocks), JSON, and numbers. Nothing is downloaded. Running the script
twice writes byte-identical files; the shipped `assets/tokenizer.json` is its output.

Design choices, each one checked by `tests/prompting/test_tokenizer.py`:
- exactly `VOCAB_SIZE` = 4096 tokens, the three special tokens included;
- digits are pre-split into runs of at most three, and every integer 0..999 occurs
  often enough in the corpus that each one becomes a single token;
- no normalizer, so decode(encode(text)) == text for every string.

This module knows how to make a tokenizer; loading one is `prompting/tokenizer.py`.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 4096
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, IM_START, IM_END]
SEED = 20240607
ASSETS_DIR = Path(__file__).resolve().parent / "assets"

# Words split off letters, digits in runs of 1..3, punctuation runs, newlines, spaces.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The built-in chat format (ChatML) as a Hugging Face template. Every line opens with
# `{%-` or `{{-`, so the newlines between lines render as nothing. The built-in
# `ChatMLFormat` in `prompting/chat_format.py` renders the same text token by token;
# its tests check that both agree.
TOOLS_INTRO = (
    "# Tools\n"
    'Call a tool by writing <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
    " Available tools:\n"
)
CHAT_TEMPLATE = "\n".join([
    r"{%- if messages and messages[0]['role'] == 'system' %}",
    r"{%- set system = messages[0]['content'] %}{%- set rest = messages[1:] %}",
    r"{%- else %}{%- set system = none %}{%- set rest = messages %}{%- endif %}",
    r"{%- if system is not none or tools %}",
    r"{{- '<|im_start|>system\n' }}",
    r"{%- if system is not none %}{{- system }}{%- endif %}",
    r"{%- if system is not none and tools %}{{- '\n\n' }}{%- endif %}",
    r"{%- if tools %}",
    r"{{- '" + TOOLS_INTRO.replace("\n", r"\n") + r"<tools>\n[' }}",
    r"{%- for t in tools %}{%- if not loop.first %}{{- ',' }}{%- endif %}",
    (r"{{- (t['function'] if t['function'] is defined else t)"
     r" | tojson(separators=(',', ':'), sort_keys=True) }}"),
    r"{%- endfor %}",
    r"{{- ']\n</tools>' }}",
    r"{%- endif %}",
    r"{{- '<|im_end|>\n' }}",
    r"{%- endif %}",
    r"{%- for message in rest %}",
    r"{%- if message['role'] == 'tool' and message['name'] %}",
    r"{{- '<|im_start|>tool name=' + message['name'] + '\n' }}",
    r"{%- else %}{{- '<|im_start|>' + message['role'] + '\n' }}{%- endif %}",
    r"{{- message['content'] + '<|im_end|>\n' }}",
    r"{%- endfor %}",
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}",
]) + "\n"

WORDS = """
the a an and or but if then else when while because so that this these those it its
is are was were be been being have has had do does did will would can could should may
might must shall not no yes all any each every some many much more most few less least
one two three four five six seven eight nine ten first second third last next previous
I you he she we they me him her us them my your his our their mine yours who what which
where why how here there now today tomorrow yesterday always never often sometimes soon
time day week month year hour minute second morning evening night people person man
woman child world life hand part place case point group number way fact thing work
home water room mother area money story month lot right study book eye job word business
issue side kind head house service friend father power game line end member law car
city community name president team minute idea kid body information back parent face
others level office door health art war history party result change reason research
girl guy moment air teacher force education foot boy age policy process music market
sense nation plan college interest death experience effect use class control care field
development role effort rate heart drug show leader light voice wife police mind price
report decision son view relationship town road arm difference value building action
model season society tax director position player record paper space ground form event
official matter center couple site project activity star table need court oil situation
cost industry figure street image phone data picture practice piece land product doctor
wall patient worker news test movie north love support technology step baby computer
type attention film tree source organization hair window evidence population site
say get make go know take see come think look want give use find tell ask work seem
feel try leave call keep let begin help talk turn start show hear play run move like
live believe hold bring happen write provide sit stand lose pay meet include continue
set learn change lead understand watch follow stop create speak read allow add spend
grow open walk win offer remember love consider appear buy wait serve die send expect
build stay fall cut reach kill remain suggest raise pass sell require report decide pull
good new old great high small large big long little own other different important
public bad same able young early late hard major better best free strong whole real
sure clear full simple easy possible short low certain recent nice open close quick
slow warm cold hot dark bright quiet loud happy sad true false correct wrong empty
very also just only even still back well too again away already almost enough quite
about above across after against along among around at before behind below beneath
between beyond by down during except for from in inside into near of off on onto out
outside over past since through throughout to toward under until up upon with within
without agent assistant user system tool tools call result answer question guess
number higher lower secret target range between correct found wins try attempts left
calculator compute add subtract multiply divide sum product total value expression
wordle letter letters green yellow gray present absent position word guesses feedback
mastermind code colors color peg pegs black white red blue orange purple exact partial
maze grid wall walls open cell cells move moves up down left right north south east west
goal start reached blocked surroundings position row column step steps map key keys
lookup table store stored entry entries missing found unknown invalid error retry json
arguments name content role reply message observation action reward done episode turn
please thanks sorry okay hello goodbye let's think carefully therefore next finally
""".split()  # noqa: SIM905

NAMES = """alice bob carol dave erin frank grace heidi ivan judy mallory oscar peggy trent
victor walter apple banana cherry river stone cloud forest silver golden ocean planet
""".split()  # noqa: SIM905


def _sentence(rng: random.Random) -> str:
    n = rng.randint(4, 16)
    words = [rng.choice(WORDS) for _ in range(n)]
    if rng.random() < 0.3:
        words.insert(rng.randint(0, n), str(rng.randint(0, 9999)))
    if rng.random() < 0.2:
        words.insert(rng.randint(0, n), rng.choice(NAMES).capitalize())
    text = " ".join(words)
    text = text[0].upper() + text[1:]
    if rng.random() < 0.15:
        cut = rng.randint(1, len(words) - 1)
        text = " ".join(words[:cut]) + ", " + " ".join(words[cut:])
    return text + rng.choice([".", ".", ".", "?", "!", ":", ";"])


def _prose(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(2, 7)))


def _turn(role: str, content: str) -> str:
    return f"{role}\n{content}\n"


def _tool_call(name: str, arguments: dict[str, object]) -> str:
    payload = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>{payload}</tool_call>"


def _guess_number(rng: random.Random) -> str:
    hi = rng.choice([10, 50, 100, 1000])
    secret = rng.randint(1, hi)
    lo_b, hi_b = 1, hi
    out = [_turn("system", f"Guess the secret number between 1 and {hi}. Reply with one number.")]
    out.append(_turn("user", f"I am thinking of a number between 1 and {hi}. Your guess?"))
    for _ in range(12):
        guess = (lo_b + hi_b) // 2
        out.append(_turn("assistant", str(guess)))
        if guess == secret:
            out.append(_turn("user", f"Correct! The number was {secret}."))
            break
        if guess < secret:
            lo_b = guess + 1
            out.append(_turn("user", f"{guess} is too low. Go higher."))
        else:
            hi_b = guess - 1
            out.append(_turn("user", f"{guess} is too high. Go lower."))
    return "".join(out)


def _calculator(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(1, 999)
    op = rng.choice(["+", "-", "*", "/"])
    expr = f"{a} {op} {b}"
    value = {"+": a + b, "-": a - b, "*": a * b, "/": round(a / b, 3)}[op]
    return (
        _turn("user", f"What is {expr}? Use the calculator.")
        + _turn("assistant", _tool_call("calculator", {"expression": expr}))
        + _turn("tool", str(value))
        + _turn("assistant", f"The answer is {value}.")
    )


def _wordle(rng: random.Random) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    out = [_turn("user", "Guess the five letter word. Feedback: G green, Y yellow, - gray.")]
    for _ in range(rng.randint(1, 5)):
        word = "".join(rng.choice(letters) for _ in range(5))
        marks = "".join(rng.choice("GY-") for _ in range(5))
        out.append(_turn("assistant", word))
        out.append(_turn("user", f"{word.upper()} {marks} ({rng.randint(1, 5)} guesses left)"))
    return "".join(out)


def _mastermind(rng: random.Random) -> str:
    colors = ["red", "blue", "green", "yellow", "orange", "purple"]
    out = [_turn("user", "Find the code of 4 colors. Feedback: black = exact, white = color only.")]
    for _ in range(rng.randint(1, 4)):
        code = [rng.choice(colors) for _ in range(4)]
        out.append(_turn("assistant", " ".join(code)))
        out.append(_turn("user", f"black: {rng.randint(0, 4)}, white: {rng.randint(0, 4)}"))
    return "".join(out)


def _maze(rng: random.Random) -> str:
    moves = ["up", "down", "left", "right"]
    r, c = rng.randint(0, 9), rng.randint(0, 9)
    out = [_turn("user", f"You are at row {r}, column {c}. Reach the goal. Moves: up, down, left, right.")]
    for _ in range(rng.randint(1, 6)):
        around = ", ".join(f"{m}: {rng.choice(['open', 'wall', 'goal'])}" for m in moves)
        out.append(_turn("user", f"Position ({r}, {c}). Surroundings: {around}."))
        move = rng.choice(moves)
        out.append(_turn("assistant", move))
        r = max(0, min(9, r + {"up": -1, "down": 1}.get(move, 0)))
        c = max(0, min(9, c + {"left": -1, "right": 1}.get(move, 0)))
    grid = "\n".join("".join(rng.choice("..#") for _ in range(6)) for _ in range(4))
    out.append(_turn("user", grid))
    return "".join(out)


def _lookup(rng: random.Random) -> str:
    key = f"{rng.choice(NAMES)}_{rng.randint(0, 99)}"
    value = rng.choice([str(rng.randint(0, 9999)), rng.choice(NAMES), rng.choice(WORDS)])
    found = rng.random() < 0.8
    return (
        _turn("user", f"What value is stored under the key {key}?")
        + _turn("assistant", _tool_call("lookup", {"key": key}))
        + _turn("tool", json.dumps({"key": key, "value": value}) if found
                else f"error: key {key!r} not found")
        + _turn("assistant", f"The value of {key} is {value}." if found else "The key is missing.")
    )


def _json_object(rng: random.Random) -> str:
    obj = {
        rng.choice(WORDS): rng.choice([rng.randint(-999, 99999), rng.choice(WORDS), True, None,
                                       round(rng.random() * 100, 2)])
        for _ in range(rng.randint(1, 5))
    }
    indent = rng.choice([None, None, 2])
    return json.dumps(obj, indent=indent, sort_keys=rng.random() < 0.5)


def _numbers(rng: random.Random) -> str:
    """Every integer 0..999 in several plain-text contexts, in shuffled order."""
    ints = list(range(1000))
    rng.shuffle(ints)
    forms = ["{}", "{}.", "{},", "({})", "= {}", "x{}", "[{}]"]
    return " ".join(rng.choice(forms).format(i) for i in ints)


def corpus(seed: int = SEED) -> Iterator[str]:
    """The training corpus, one document at a time (deterministic for a seed)."""
    rng = random.Random(seed)
    generators = [_prose, _guess_number, _calculator, _wordle, _mastermind, _maze, _lookup,
                  _json_object]
    for _ in range(60):
        yield _numbers(rng)
    for _ in range(12000):
        yield rng.choice(generators)(rng)


def train_tokenizer(seed: int = SEED) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(seed), trainer=trainer)
    return tokenizer


def tokenizer_config() -> dict[str, object]:
    """What transformers' `AutoTokenizer.from_pretrained` reads beside tokenizer.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": 1_000_000,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }


def write(out_dir: Path, seed: int = SEED) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(seed)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"trained {tokenizer.get_vocab_size()} tokens, want {VOCAB_SIZE}: enlarge the corpus"
        )
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    config = json.dumps(tokenizer_config(), indent=2, sort_keys=True) + "\n"
    (out_dir / "tokenizer_config.json").write_text(config, encoding="utf-8")
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    out_dir = Path(args[0]) if args else ASSETS_DIR
    write(out_dir)
    print(f"wrote {out_dir}/tokenizer.json ({VOCAB_SIZE} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
