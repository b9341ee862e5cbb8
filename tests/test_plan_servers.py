"""Partitioning parameters over servers by size: exact, against tables worked out by hand."""

import pytest

from polytrain.errors import ConfigError
from polytrain.planning.servers import ServerPlan, check_servers, partition_by_size


def test_one_server_holds_everything():
    assert partition_by_size([5, 1, 9], servers=1) == (0, 0, 0)


def test_largest_first_to_the_least_loaded_server():
    # 10 -> s0 (10 | 0); 5 (index 2) -> s1 (10 | 5); 5 (index 3) -> s1 (10 | 10); 1 -> tie -> s0 (11 | 10)
    assert partition_by_size([10, 1, 5, 5], servers=2) == (0, 0, 1, 1)


def test_lenet_like_sizes_balance_the_big_dense_layer_against_the_rest():
    # conv1 w/b, conv2 w/b, fc1 w/b, fc2 w/b: fc1's weight alone on one server, everything else on the other
    sizes = [500, 20, 25000, 50, 409600, 512, 5120, 10]
    owner = partition_by_size(sizes, servers=2)
    assert owner == (1, 1, 1, 1, 0, 1, 1, 1)
    assert sum(s for s, k in zip(sizes, owner) if k == 1) == 31212


def test_three_servers_by_hand():
    # 7 -> s0; 6 -> s1; 5 -> s2; 4 -> s2 (9); 3 -> s1 (9); 2 -> s0 (9); 1 -> s0 (10)
    assert partition_by_size([1, 2, 3, 4, 5, 6, 7], servers=3) == (0, 0, 1, 2, 2, 1, 0)
    assert ServerPlan(3, "cpu", (0, 0, 1, 2, 2, 1, 0)).owned(0) == (0, 1, 6)


@pytest.mark.parametrize("servers, devices", [(2, 2), (0, 2), (3, 3)])
def test_servers_need_a_worker_beside_them(servers, devices):
    with pytest.raises(ConfigError, match=f"--servers {servers} needs a worker"):
        check_servers(servers, devices=devices)


def test_unknown_server_device():
    with pytest.raises(ConfigError, match="--server-device 'gpu'"):
        ServerPlan(1, "gpu", (0,))
