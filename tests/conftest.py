"""Test settings: the tests folder is importable (its helpers), warnings stay quiet, a module that sets
LIMIT_S has each of its tests bounded by that many seconds, and tests marked `slow` (more variants of
what another test covers) run only with `--all`."""

import fnmatch
import os
import signal
import sys
import tempfile

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Four CPU devices for JAX's meshes (set before JAX is first imported); the other tests use the first.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One compute thread a process (set before torch is first imported), as torchrun gives its workers: the tests
# run many processes at once (two pytest workers, each with its ranks), and more threads than cores wait on
# each other.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# XLA's compiles kept on disk for this run (a new folder each run, so nothing is reused from an older one):
# the tests compile many identical steps, each a quarter faster to find again than to compile.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="linnet-tests-xla-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


@pytest.fixture(autouse=True)
def bounded(request):
    """In a module that sets LIMIT_S, each test fails, rather than hangs, past LIMIT_S seconds
    (SIGALRM: there is no pytest-timeout)."""
    limit = getattr(request.module, "LIMIT_S", None)
    if limit is None:
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"the test ran past {limit} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(limit)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true",
                     help="also run the tests marked slow: further variants (worlds, compilers, meshes) of what the "
                          "default run covers once")


# Further variants of what the default run covers once, by test id (fnmatch patterns; "[[]" is a literal
# "["): other world sizes, the compiled or untied twin of a test whose eager or tied form runs, more meshes,
# and the example scripts' slower runs. `pytest --all tests` runs them too.
SLOW = (
    "test_fully_shard.py::test_sharded_training_equals_single_process[[]1]",
    "test_fully_shard.py::test_sharded_training_equals_single_process[[]4]",
    "test_fully_shard.py::test_a_looked_up_embedding_trains_as_single_process[[][34]-None]",
    "test_fully_shard.py::test_a_looked_up_embedding_trains_as_single_process[[]2-inductor]",
    "test_fully_shard.py::test_a_looked_up_tables_gradient_is_single_process_one[[][24]]",
    "test_fully_shard.py::test_gathers_kept_for_the_backward_*[[]1-*]",
    "test_fully_shard.py::test_gathers_kept_for_the_backward_*[[]2-inductor]",
    "test_fully_shard.py::test_the_matmuls_policy_keeps_products_and_recomputes_the_rest[[]1]",
    "test_fully_shard.py::test_compiled_the_matmuls_policy_recomputes_no_product",
    "test_fully_shard.py::test_compiled_and_other_recompute_policies_equal_eager_gather[[]inductor-matmuls]",
    "test_drop_in.py::test_compiled_batches_of_other_lengths_compile_once_more_and_train_as_transformers",
    "test_fully_shard.py::test_prefetch_depths_train_alike_when_compiled[[]3]",
    "test_fully_shard.py::test_prefetched_training_at_world_4_equals_single_process",
    "test_fully_shard.py::test_a_layer_compiled_once_trains_as_single_process[[]1-matmuls]",
    "test_fully_shard.py::test_a_layer_compiled_once_trains_as_single_process[[]2-full]",
    "test_hybrid.py::test_a_2d_mesh_trains_as_single_process[[]shape[234]-*]",
    "test_hybrid.py::*[[]inductor]",
    "test_hybrid.py::test_a_looked_up_embedding_on_a_2d_mesh_trains_as_single_process[[]shape[12]-*]",
    "test_hybrid.py::test_each_part_is_reduced_once_inside_its_machine_and_once_across[[]True]",
    "test_hybrid.py::test_two_machines_on_the_loopback_pick_hybrid_sharding_and_train_as_one",
    "test_step_in_backward.py::test_training_that_steps_in_the_backward_equals_stepping_after[[]1-None]",
    "test_step_in_backward.py::test_training_that_steps_in_the_backward_equals_stepping_after[[]2-inductor]",
    "test_step_in_backward.py::test_on_one_rank_*[[]inductor]",
    "test_step_in_backward.py::test_a_backward_inside_steps_every_part_and_keeps_no_gradient[[]inductor]",
    "test_step_in_backward.py::test_each_part_steps_as_soon_as_its_gradient_is_complete[[]1]",
    "test_schedule.py::test_compiled_step_runs_the_schedule[[]1]",
    "test_jax_train.py::*[[]untied*",
    "test_jax_train.py::test_sharded_training_equals_one_device[[]tied-[14]-1-False]",
    "test_jax_train.py::test_sharded_training_equals_one_device[[]tied-3-1-True]",
    "test_jax_train.py::test_a_replicated_mesh_trains_as_one_device[[]tied-shape[12]-*]",
    "test_jax_train.py::test_remat_recomputes_the_same_step[[]tied-fast]",
    "test_jax_load.py::test_random_parts_are_the_unsharded_draw[[][14]-*]",
    "test_jax_load.py::test_checkpoint_parts_read_each_range_once[[]1]",
    "test_jax_load.py::test_the_fast_loss_equals_the_exact_one_without_the_rows_f32_logits[[]2050-*]",
    "test_jax_hosts.py::*[[]untied]",
    "test_load_parts.py::*[[][14]]",
    "test_families.py::test_f32_matches_transformers[[]*-fast-*]",
    "test_families.py::test_packed_row_equals_transformers_on_each_document[[]fast-*]",
    "test_families.py::test_sharded_training_equals_single_process[[][13]]",
    "test_families.py::test_jax_equals_pytorch_training_from_the_same_card[[]qwen2]",
    "test_families.py::test_jax_equals_pytorch_training_from_the_same_card[[]mistral]",
    "test_families.py::test_saved_weights_load_in_transformers_with_the_same_logits[[]jax_source-*]",
    "test_packed.py::test_packed_row_equals_documents_alone[[]*-fast]",
    "test_one_document.py::*[[]1]",
    "test_linear_cross_entropy.py::test_as_the_generated_codes_loss_it_trains_a_card_alike[[]inductor]",
    "test_train_options.py::*[[]1-to-3]",
    "test_example_scripts.py::test_jax_example_stops_on_mistakes_before_training",
    "test_example_scripts.py::test_torch_example_stops_on_mistakes_before_training",
    "test_example_scripts.py::test_a_finished_run_run_again_writes_out[[]jax]",
    "test_example_scripts.py::test_the_*_example_resumes_on_another_number_of_*",
    "test_example_scripts.py::test_a_finished_run_run_again_writes_out[[]torch]",
    "test_hybrid.py::test_a_bf16_reduction_applies_inside_and_across_machines",
    "test_jax_hosts.py::test_processes_that_find_different_checkpoints_stop_together_naming_each[[]tied]",
    "test_jax_hosts.py::test_a_save_that_fails_on_the_first_process_stops_every_process[[]tied]",
    "test_jax_hosts.py::test_a_process_whose_rows_run_out_first_stops_every_process[[]tied]",
    "test_rank_loss.py::test_a_stopped_rank_ends_the_run_within_the_stall_timeout_naming_it",
    "test_rank_loss.py::test_a_lost_machine_ends_the_other_within_a_minute_naming_its_ranks",
    "test_fully_shard.py::test_a_compiled_sharded_step_prints_no_context_fn_warning",
    "test_fully_shard.py::test_prefetch_depths_train_alike_when_compiled[[]2]",
    "test_schedule.py::test_with_replicas_each_all_reduce_runs_under_the_layers_below",
    "test_schedule.py::test_without_prefetch_each_gather_is_waited_for_before_the_next_is_launched",
    "test_schedule.py::test_on_one_rank_a_gather_is_a_cast_made_again_in_the_backward",
    "test_jax_train.py::test_a_checkpoint_resumes_in_the_other_layer_form[[]tied]",
    "test_jax_train.py::test_bf16_sharded_training_follows_bf16_reference[[]tied]",
    "test_jax_train.py::test_an_optimizer_state_not_shaped_as_the_parts_trains_and_resumes[[]tied]",
    "test_jax_train.py::test_bf16_optimizer_state_is_checkpointed[[]tied]",
    "test_jax_train.py::test_a_replicated_mesh_trains_as_one_device[[]tied-shape3-*]",
    "test_jax_train.py::test_sharded_training_equals_one_device[[]tied-3-1-False]",
    "test_jax_train.py::test_remat_recomputes_the_same_step[[]tied-exact]",
    "test_step_in_backward.py::test_a_changed_setting_compiles_the_step_again",
    "test_step_in_backward.py::test_the_step_in_the_backward_compiles_at_the_first_attempt",
    "test_step_in_backward.py::test_a_second_optimizer_steps_in_the_backward_as_after[[]inductor]",
    "test_checkpoint_settings.py::test_jax_*_a_new_learning_rate_*",
    "test_checkpoint.py::test_a_checkpoint_resumes_at_another_world_size",
    "test_ops.py::test_cpp_googletest*",
    "test_drop_in.py::test_each_family_trains_as_one_process_in_the_users_loop[[]3]",
    "test_parity.py::test_compiled_equals_eager[[]gqa2-tied-llama3]",
    "test_step_in_backward.py::test_training_that_steps_in_the_backward_equals_stepping_after[[]1-inductor]",
    "test_ops.py::test_collectives_match_reference[[][14]]",
    "test_held_gradients.py::test_held_micro_batches_give_the_synced_gradients[[]3-None]",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.nodeid.rsplit("/", 1)[-1]
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in SLOW):
            item.add_marker(pytest.mark.slow)
    if config.getoption("--all"):
        return
    skip = pytest.mark.skip(reason="slow: a further variant of what the default run covers (pytest --all runs it)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
