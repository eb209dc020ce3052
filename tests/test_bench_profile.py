"""bench/profile_stubs.py: py-spy's raw stacks into categories (no server, no py-spy)."""

from __future__ import annotations

from bench.profile_stubs import parse_raw

DECODE = "_run (rngd_pd/engine/decode.py:340);_step (rngd_pd/engine/decode.py:400)"
LOAD = "_load (rngd_pd/engine/decode.py:380)"

RAW = f"""\
{DECODE};decode_step (rngd_pd/model/llama.py:300);_linear (rngd_pd/model/llama.py:88) 60
_run (rngd_pd/stubs/sending.py:108);send (rngd_pd/stubs/pbutils.py:174) 10
{LOAD};receive_into (rngd_pd/kv/handoff.py:150);pull (rngd_pd/kv/shm/transport.py:300) 20
{LOAD};pull (rngd_pd/kv/shm/transport.py:300);_wait_open (rngd_pd/kv/shm/transport.py:204) 5
_bootstrap (threading.py:1002);wait (threading.py:331);Condition.wait (threading.py:331) 4
main (x.py:1) 1
"""


def test_samples_are_put_in_their_innermost_category() -> None:
    cats, funcs, total = parse_raw(RAW)
    assert total == 100
    assert cats["model compute"] == 60 and cats["responses"] == 10 and cats["kv transport"] == 20
    assert cats["waiting"] == 9 and cats["other"] == 1
    assert funcs.most_common(1)[0] == ("_linear (rngd_pd/model/llama.py:88)", 60)


def test_the_orchestrator_is_orchestration_not_engine_work() -> None:
    """engine/orchestrator.py sits under rngd_pd/engine/ but is pd's orchestration."""
    cats, _, total = parse_raw(
        "_bootstrap (threading.py:1002);run (rngd_pd/engine/orchestrator.py:250) 3\n"
        "stream (rngd_pd/stubs/clients.py:270) 2\n"
        f"{DECODE} 5\n"
    )
    assert total == 10 and cats["orchestration"] == 5 and cats["engine host work"] == 5
