"""linnet.torch.agree: what the ranks agree on travels on a group that takes CPU tensors."""

from __future__ import annotations

import torch.distributed as dist

from distributed import run


def agree_before_and_after_a_new_init(rank: int, world: int, store_file: str) -> list:
    """Every rank's message over the default group (of a backend that takes no CPU tensors), then again
    after destroy_process_group and a new init, whose default group has the same name and numbers the
    processes the other way round."""
    from linnet.torch import agree

    said = []
    for attempt in range(2):
        group = dist.group.WORLD
        assert {device.type for device in group._device_types} == {"cuda"}, "the test needs a group of no CPU tensors"
        made = agree.cpu_group()
        assert made is not group and agree.cpu_group() is made  # made once a group
        said.append((group.group_name, agree._messages(f"process {rank if attempt == 0 else world - 1 - rank}")))
        dist.destroy_process_group()
        rank = world - 1 - rank
        dist.init_process_group("cuda:gloo", init_method=f"file://{store_file}-{attempt}", rank=rank, world_size=world)
    return said


def test_a_new_default_group_of_an_old_name_gets_a_cpu_group_of_its_own(tmp_path):
    """A Gloo group made for the old group is not the new one's: it would order the ranks as the old did."""
    first_process, second_process = run(agree_before_and_after_a_new_init, 2, str(tmp_path / "store"),
                                        backend="cuda:gloo", timeout=60)
    for said in (first_process, second_process):
        (first_name, first), (second_name, second) = said
        assert first_name == second_name  # the name comes again
        assert first == ["process 0", "process 1"]  # in the first init's rank order
        assert second == ["process 1", "process 0"]  # in the second's: the first process is rank 1 there
