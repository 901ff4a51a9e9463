"""The replica router's decisions (pure Python, no Ray), and that one process never imports Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.block_manager import BlockManager
from engine.input_processor import PreparedRequest
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from web.cluster.router import PrefixMemory, Router, prompt_block_hashes

from tests.support.server_harness import REPO


def test_prompt_hashes_are_the_block_managers_own() -> None:
    tokens = list(range(100, 150))
    seq = Sequence(0, PreparedRequest("r", tokens, SamplingParams(max_tokens=4), 4), detokenizer=None)
    manager = BlockManager(num_blocks=8, block_size=16)
    manager.update_hashes(seq)
    assert prompt_block_hashes(tokens, 16) == seq.block_hashes
    assert len(seq.block_hashes) == 3  # full blocks only


def test_memory_finds_the_longest_prefix_and_who_holds_it() -> None:
    memory = PrefixMemory(capacity=100)
    shared, history = prompt_block_hashes(list(range(64)), 16), prompt_block_hashes(list(range(64)) + [7] * 32, 16)
    memory.record(shared, 0)
    memory.record(shared, 1)
    memory.record(history, 1)
    assert memory.longest_match(history + [12345]) == (6, 0b10)
    assert memory.longest_match(shared) == (4, 0b11)
    assert memory.longest_match([999]) == (0, 0)
    memory.forget(1)
    assert memory.longest_match(history) == (4, 0b01)


def test_memory_is_bounded_and_evicts_the_least_recently_routed() -> None:
    memory = PrefixMemory(capacity=4)
    old, new = [1, 2, 3], [4, 5, 6]
    memory.record(old, 0)
    memory.record(new, 1)
    assert len(memory) == 4
    # The old prompt's tail went first: its head is still known, as a block manager would still hold it.
    assert memory.longest_match(old) == (1, 0b01)
    assert memory.longest_match(new) == (3, 0b10)


def test_affine_follows_the_prefix_until_load_crosses_both_thresholds() -> None:
    router = Router("affine", 2, memory_blocks=1000, balance_abs=8, balance_rel=1.5)
    conversation = prompt_block_hashes(list(range(160)), 16)
    first = router.choose(conversation[:5], {0: 0, 1: 0})
    assert first is not None and first.reason == "least_loaded"
    home = first.replica
    other = 1 - home
    assert router.choose(conversation, {home: 3, other: 0}).replica == home  # gap 3: affinity wins
    assert router.choose(conversation, {home: 30, other: 21}).replica == home  # gap 9 but 30 < 1.5 * 21
    moved = router.choose(conversation, {home: 9, other: 0})  # gap 9 > 8 and 9 > 1.5 * 0
    assert moved is not None and (moved.replica, moved.reason) == (other, "load")
    # Now both replicas hold the conversation: the less loaded of them takes it.
    assert router.choose(conversation, {home: 2, other: 1}).replica == other
    # A short match (under half of the prompt's blocks) does not bind the request.
    unrelated = conversation[:2] + prompt_block_hashes(list(range(500, 660)), 16)
    assert router.choose(unrelated, {home: 1, other: 0}).reason == "least_loaded"
    assert router.decisions["prefix"] == 3


def test_a_prefix_every_replica_holds_leaves_the_choice_to_load() -> None:
    router = Router("affine", 2, memory_blocks=1000)
    system = prompt_block_hashes(list(range(96)), 16)
    router.memory.record(system, 0)
    router.memory.record(system, 1)
    route = router.choose(system, {0: 2, 1: 1})
    assert route is not None and (route.replica, route.reason) == (1, "prefix")


def test_round_robin_and_least_loaded_ignore_prefixes() -> None:
    hashes = prompt_block_hashes(list(range(64)), 16)
    rr = Router("round_robin", 3, memory_blocks=10)
    assert [rr.choose(hashes, {0: 0, 1: 5, 2: 0}).replica for _ in range(4)] == [0, 1, 2, 0]
    ll = Router("least_loaded", 3, memory_blocks=10)
    assert ll.choose(hashes, {0: 4, 1: 2, 2: 3}).replica == 1
    assert {ll.choose(hashes, {0: 1, 2: 1}).replica for _ in range(4)} == {0, 2}  # ties are shared
    assert ll.choose(hashes, {}) is None
    assert len(ll.memory) == 0


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="routing policy"):
        Router("random", 2, memory_blocks=10)


def test_one_process_never_imports_ray() -> None:
    code = (
        "import sys; from engine.config import load_config; from web.server import build_engine; "
        "from web.app import create_app; c = load_config(environ={}); e = build_engine(c); "
        "create_app(e, c.server); print('ray' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
