"""prefixgym.tinker's RestClient and tinker:// paths: every training client is a run
under the checkpoint root, its checkpoints named as the hosted service names them, and
another process on the same root (a resumed cookbook recipe) finds them."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tinker.types")
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from prefixgym.tinker import ServiceClient  # noqa: E402


def test_saved_paths_are_tinker_paths_of_the_run_and_load_back(tmp_path: Path) -> None:
    with ServiceClient(checkpoint_dir=tmp_path, user_metadata={"renderer_name": "role_colon"}
                       ) as client:
        trainer = client.create_lora_training_client(base_model="tiny", rank=4,
                                                     user_metadata={"note": "a"}).result()
        state = trainer.save_state("000001").result().path
        sampler = trainer.save_weights_for_sampler("000001").result().path
    assert state == f"tinker://{trainer.model_id}/weights/000001"
    assert sampler == f"tinker://{trainer.model_id}/sampler_weights/000001"
    parsed = types.ParsedCheckpointTinkerPath.from_tinker_path(state)  # the SDK's parser
    assert (parsed.training_run_id, parsed.checkpoint_id) == (trainer.model_id, "weights/000001")
    assert trainer.model_id.endswith(":train:0") and trainer.get_info().model_id == trainer.model_id

    # another process, the same root: a resumed recipe reads the run and loads the state
    with ServiceClient(checkpoint_dir=tmp_path) as later:
        rest = later.create_rest_client()
        run = rest.get_training_run_by_tinker_path(state).result()
        assert run.training_run_id == trainer.model_id and run.base_model == "tiny"
        assert (run.is_lora, run.lora_rank) == (True, 4)
        assert run.user_metadata == {"renderer_name": "role_colon", "note": "a"}
        assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state
        assert run.last_sampler_checkpoint is not None
        resumed = later.create_training_client_from_state_with_optimizer(
            state, user_metadata={"renderer_name": "role_colon"}).result()
        assert resumed.model_id != trainer.model_id  # a new run, as on the service
        assert resumed.get_info().lora_rank == 4
        info = rest.get_weights_info_by_tinker_path(sampler).result()
        assert (info.base_model, info.is_lora, info.lora_rank) == ("tiny", True, 4)
        assert later.create_sampling_client(model_path=sampler).result().get_base_model() == "tiny"


def test_runs_and_checkpoints_are_listed_published_and_deleted(tmp_path: Path) -> None:
    with ServiceClient(checkpoint_dir=tmp_path) as client:
        first = client.create_training_client(base_model="tiny").result()
        second = client.create_training_client(base_model="tiny").result()
        one = first.save_state("one").result().path
        two = first.save_state("two").result().path
        rest = client.create_rest_client()
        runs = rest.list_training_runs(limit=1).result()
        assert runs.cursor.total_count == 2 and len(runs.training_runs) == 1
        assert {r.training_run_id for r in rest.list_training_runs().result().training_runs} == {
            first.model_id, second.model_id}
        listed = rest.list_checkpoints(first.model_id).result().checkpoints
        assert [c.checkpoint_id for c in listed] == ["weights/one", "weights/two"]
        assert [c.tinker_path for c in listed] == [one, two]
        assert all(c.checkpoint_type == "training" and c.size_bytes for c in listed)
        rest.publish_checkpoint_from_tinker_path(two).result()
        assert [c.public for c in rest.list_checkpoints(first.model_id).result().checkpoints] \
            == [False, True]
        rest.set_checkpoint_ttl_from_tinker_path(one, 60).result()  # accepted: none expire
        assert rest.get_telemetry() is None and client.get_telemetry() is None
        rest.delete_checkpoint_from_tinker_path(one).result()
        assert [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints] == [two]
        assert rest.get_training_run(second.model_id).result().last_checkpoint is None


def test_a_missing_run_is_a_tinker_error_and_a_plain_path_a_value_error(tmp_path: Path) -> None:
    with ServiceClient(checkpoint_dir=tmp_path) as client:
        rest = client.create_rest_client()
        with pytest.raises(tinker.TinkerError, match="no training run 'nope:train:0'"):
            rest.get_training_run("nope:train:0")
        with pytest.raises(tinker.TinkerError):
            rest.delete_checkpoint_from_tinker_path("tinker://nope:train:0/weights/x")
        # the cookbook reads the renderer of a local path through this and catches these
        with pytest.raises(ValueError, match="Invalid tinker path"):
            rest.get_training_run_by_tinker_path(str(tmp_path / "state"))
        with pytest.raises(ValueError, match="Invalid tinker path"):
            rest.get_training_run_by_tinker_path("tinker://run/checkpoints/x")


def test_the_cookbook_reads_the_renderer_of_a_checkpoint(tmp_path: Path) -> None:
    checkpoint_utils = pytest.importorskip("tinker_cookbook.checkpoint_utils")
    with ServiceClient(checkpoint_dir=tmp_path, user_metadata={"renderer_name": "role_colon"}
                       ) as client:
        trainer = client.create_training_client(base_model="tiny").result()
        state = trainer.save_state("final").result().path
        assert checkpoint_utils.get_renderer_name_from_checkpoint(client, state) == "role_colon"
        assert checkpoint_utils.get_renderer_name_from_checkpoint(client, "/not/tinker") is None


def test_server_capabilities_are_the_local_engines_models(tmp_path: Path) -> None:
    with ServiceClient(checkpoint_dir=tmp_path) as client:
        models = {m.model_name: m for m in client.get_server_capabilities().supported_models}
        assert {"tiny", "small"} <= set(models)
        assert models["tiny"].max_context_length == 2048
        assert models["tiny"].trainable and models["tiny"].sampleable
        rest = client.create_rest_client().get_server_capabilities().result()
        assert [m.model_name for m in rest.supported_models] == list(models)
