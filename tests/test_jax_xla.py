"""linnet.jax.xla: the compile options Linnet asks of XLA on GPUs, and the user's XLA_FLAGS winning."""

from linnet.jax import xla


def test_the_options_are_for_gpus_only_and_the_users_flags_win(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    xla.xla_options.cache_clear()
    assert xla.xla_options("cpu") == {}
    chosen = xla.xla_options("gpu")  # each checked by a compile on this machine's backend
    assert "xla_gpu_enable_command_buffer" in chosen and set(chosen) <= set(xla.GPU_OPTIONS)

    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer= --xla_force_host_platform_device_count=4")
    xla.xla_options.cache_clear()
    assert xla.user_flags() == {"xla_gpu_enable_command_buffer", "xla_force_host_platform_device_count"}
    assert set(xla.xla_options("gpu")) == set(chosen) - {"xla_gpu_enable_command_buffer"}
    xla.xla_options.cache_clear()
