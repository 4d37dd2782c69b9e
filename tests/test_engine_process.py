"""The server's engine process: an abort mid-step frees pages, the engine dying fails every request in
flight loudly, and no process outlives the server. Real `flexengine serve` processes on loopback."""
from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from flexengine.outputs import CompletionDelta
from flexengine.server import engine_process

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from slow_step_serve import SLOW_STEP_S  # noqa: E402
from test_server import ENGINE_ARGS, free_port, launch_server, metrics, stop_server, wait_idle, wait_ready  # noqa: E402

SLOW_SERVE = os.path.join(os.path.dirname(__file__), "slow_step_serve.py")


def launch_slow_server():
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="flexengine-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, SLOW_SERVE, "serve", "--host", "127.0.0.1", "--port", str(port),
           "--uvicorn-log-level", "warning", *ENGINE_ARGS]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}", log


def children(pid: int) -> list[int]:
    """Live child processes of pid (the engine process and multiprocessing's resource tracker)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except FileNotFoundError:  # exited while we looked
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def engine_pid(server_pid: int) -> int:
    pids = [p for p in children(server_pid) if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
    assert len(pids) == 1, pids
    return pids[0]


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while any(running(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if running(p)]}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def servers():
    """A slow-step server, and two plain ones to stop, started together."""
    slow, plain, to_kill = launch_slow_server(), launch_server(*ENGINE_ARGS), launch_server(*ENGINE_ARGS)
    try:
        for proc, url, log in (slow, plain, to_kill):
            wait_ready(proc, url, log)
        yield slow, plain, to_kill
    finally:
        for proc, _, _ in (slow, plain, to_kill):
            stop_server(proc)


def test_abort_mid_step_frees_pages_by_the_next_step(servers):
    _, base_url, _ = servers[0]
    idle = wait_idle(base_url)
    generated_before = idle["flexengine:generation_tokens_total"]
    body = {"prompt": "x" * 40, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert metrics(base_url)["flexengine:num_free_kv_blocks"] < idle["flexengine:num_free_kv_blocks"]
        # The engine sleeps through nearly all of each step: the abort arrives mid-step.
    closed = time.monotonic()
    while metrics(base_url)["flexengine:num_free_kv_blocks"] != idle["flexengine:num_free_kv_blocks"]:
        assert time.monotonic() - closed < 2 * SLOW_STEP_S + 1.0, "pages not freed by the step after the abort"
        time.sleep(0.02)
    assert metrics(base_url)["flexengine:generation_tokens_total"] - generated_before < 20


def test_engine_death_fails_requests_in_flight_and_health(servers):
    proc, base_url, _ = servers[0]
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=30)
    kwargs = dict(model="default", prompt="hello", max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
    errors = {}

    def whole():
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(**kwargs)
        errors["whole"] = info.value

    waiter = threading.Thread(target=whole)
    waiter.start()
    stream = iter(client.completions.create(**kwargs, stream=True))
    next(stream)
    deadline = time.monotonic() + 10
    while metrics(base_url)["flexengine:num_requests_running"] != 2:  # both in flight
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(engine_pid(proc.pid), signal.SIGKILL)
    with pytest.raises(openai.APIError) as info:
        for _ in stream:
            pass
    assert "engine process exited unexpectedly" in str(info.value)
    waiter.join(timeout=30)
    assert "engine process exited unexpectedly" in str(errors["whole"])
    health = httpx.get(base_url + "/health")
    assert health.status_code == 503 and "engine process exited unexpectedly" in health.text
    with pytest.raises(openai.InternalServerError):
        client.completions.create(**{**kwargs, "max_tokens": 2})


def test_no_process_outlives_the_server(servers):
    plain, to_kill = servers[1][0], servers[2][0]
    left = children(plain.pid)
    assert len(left) >= 1
    stop_server(plain)  # SIGTERM: the server stops its engine process
    wait_gone(left)
    left = children(to_kill.pid)
    to_kill.kill()  # SIGKILL: the engine process sees its input pipe close
    to_kill.wait()
    wait_gone(left)


def test_engine_process_freezes_its_start_up_heap(servers):
    """Start-up objects leave garbage collection (a full collection walked all of them while serving)."""
    import re
    _, (_, _, log), _ = servers
    log.seek(0)
    found = re.search(r"(\d+) start-up objects left out of garbage collection", log.read())
    assert found and int(found.group(1)) > 10_000, found


row_st = st.builds(
    CompletionDelta, st.text(max_size=5), st.integers(0, 3), st.text(max_size=8), st.lists(st.integers(0, 99), max_size=3),
    st.none() | st.lists(st.dictionaries(st.integers(0, 99), st.floats(allow_nan=False), max_size=2), max_size=2),
    st.none() | st.floats(allow_nan=False), st.sampled_from([None, "stop", "length", "abort"]),
    st.none() | st.integers(0, 99) | st.text(max_size=3), st.integers(0, 64))


@settings(max_examples=50, deadline=None)
@given(rows=st.lists(row_st, max_size=6))
def test_step_outputs_pickle_their_rows_as_columns(rows):
    """A step's message comes back as it was sent, its rows as CompletionDelta (the API reads fields by name)."""
    message = engine_process.StepOutputs([engine_process.Accepted("a", "hi", [1, 2])], [("b", "too long")], rows,
                                         engine_process.EngineSnapshot(3, 8, 2))
    back = pickle.loads(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    assert back == message and all(type(row) is CompletionDelta for row in back.deltas)


def test_loop_stats_split_the_busy_time(monkeypatch, caplog):
    """The engine loop's stats line: the interval's device wait, send wait and the rest (host work)
    as shares of the busy time; the next interval starts from the engine's running total."""
    import re
    from types import SimpleNamespace

    monkeypatch.setattr(engine_process, "STATS_INTERVAL_S", 0.0)
    engine = SimpleNamespace(device_wait_s=10.0, get_num_unfinished_requests=lambda: 3)
    stats = engine_process.LoopStats(engine.device_wait_s, engine_process.compile_count())
    time.sleep(0.2)
    engine.device_wait_s += 0.1  # about half the interval on the device
    stats.send_s, stats.steps, stats.tokens, stats.arrived = 0.05, 4, 8, 2
    with caplog.at_level("INFO", logger="flexengine.server.engine_process"):
        following = stats.maybe_log(engine)
    line = caplog.records[-1].getMessage()
    device, send, host = map(int, re.search(r"device (\d+)%, waiting to send (\d+)%, host work (\d+)%", line).groups())
    assert 30 <= device <= 50 and 15 <= send <= 25 and device + send + host in (99, 100, 101), line
    assert "3 requests (2 arrived)" in line and following.device_s_at_start == engine.device_wait_s and following.steps == 0
    assert not any(r.levelname == "WARNING" for r in caplog.records)  # nothing compiled meanwhile

    # A graph compiled while serving (a shape start-up missed) is logged as a warning, once per interval.
    monkeypatch.setattr(engine_process, "compile_count", lambda: following.compiles_at_start + 2)
    following.steps = 1
    with caplog.at_level("INFO", logger="flexengine.server.engine_process"):
        after = following.maybe_log(engine)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "2 graphs compiled while serving" in warnings[0]
    assert after.compiles_at_start == following.compiles_at_start + 2
