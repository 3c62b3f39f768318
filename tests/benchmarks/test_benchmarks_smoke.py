"""The benchmarks run end to end on tiny inputs and print every figure (no timing is asserted).

Each benchmark is run as a user would (`python -m bench.<name> --tiny --json ...`) against a real
gateway on 127.0.0.1; the test checks the printed `FIGURE name value` lines and the JSON file.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import default_trace_path, percentile, plain_envoy_bootstrap, pool_cluster
from bench.peers import PEERS, Peer, unavailable
from bench.replay import POLICIES, TraceRequest, messages_for, oracle_reused_blocks

ROOT = Path(__file__).resolve().parents[2]


def run_bench(module: str, tmp_path: Path, *args: str, timeout: float = 240) -> tuple[dict[str, str], dict]:
    """Run `python -m bench.<module> --tiny --json <tmp>/<module>.json ARGS`; return the printed
    figures (name -> text) and the JSON document."""
    out = tmp_path / f"{module}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", "--tiny", "--json", str(out), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    figures = {}
    for line in done.stdout.splitlines():
        if line.startswith("FIGURE "):
            _, name, value = line.split(" ", 2)
            figures[name] = value
    return figures, json.loads(out.read_text())


def report_again(module: str, tmp_path: Path) -> set[str]:
    """`python -m bench.<module> --from-json` on the saved result: the figures printed again."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", f"bench.{module}", "--from-json", str(tmp_path / f"{module}.json")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    return {line.split(" ")[1] for line in done.stdout.splitlines() if line.startswith("FIGURE ")}


def assert_numbers(figures: dict[str, str], names: list[str]) -> None:
    missing = [name for name in names if name not in figures]
    assert not missing, f"figures missing: {missing}"
    for name in names:  # a number, or "-" where the tiny run could not measure it (NaN)
        assert figures[name] == "-" or math.isfinite(float(figures[name])), (name, figures[name])


def test_overhead_prints_every_figure(tmp_path):
    figures, result = run_bench("overhead", tmp_path)
    names = [f"added_{p}_ms@{rate}" for rate in ("20", "50") for p in ("p50", "p90", "p99", "")]
    names = [name.replace("added__ms", "decision_mean_ms") for name in names]
    names += [f"extproc_cpu_ms_per_request@{rate}" for rate in ("20", "50")]
    names += ["saturation_plain_rps", "saturation_gateway_rps", "throughput_ratio",
              "extproc_cpu_ms_per_request", "requests_per_extproc_core_s",
              "saturation_rps:floor", "extproc_cpu_ms_per_request:floor", "requests_per_extproc_core_s:floor"]
    assert_numbers(figures, names)
    for entry in result["rates"]:
        for path in ("plain", "gateway", "floor"):
            assert entry[path]["ok"] > 0 and entry[path]["latencies_ms"] and entry[path]["errors"] == 0
    assert result["saturation"]["gateway"]["ok"] > 0
    # every peer is either measured like the other paths or skipped with its reason
    for peer in PEERS:
        measured = peer.name in result["paths"]
        assert measured != (peer.name in result["skipped_peers"]), peer.name
        if measured:
            assert all(entry[peer.name]["ok"] > 0 for entry in result["rates"])
            assert f"saturation_rps:{peer.name}" in figures
        else:
            assert result["skipped_peers"][peer.name] == unavailable(peer)
    assert report_again("overhead", tmp_path) == set(figures)


def test_workers_prints_requests_per_worker_for_1_and_2_workers(tmp_path):
    figures, result = run_bench("workers", tmp_path)
    names = [f"{name}@{n}" for n in ("1", "2") for name in (
        "saturation_rps", "rps_per_worker", "smallest_worker_share", "worker_cpu_ms_per_request", "requests_per_worker_core_s",
        "envoy_cpu_ms_per_request", "load_average")]
    assert_numbers(figures, [*names, "scaling_rps@2_over_1"])
    for n, run in result["runs"].items():
        assert run["errors"] == 0 and run["ok"] > 0
        assert len(run["worker_decisions"]) == int(n) and sum(run["worker_decisions"]) >= run["ok"]
        assert all(decided > 0 for decided in run["worker_decisions"])  # Envoy sends streams to every worker
    assert report_again("workers", tmp_path) == set(figures)


def test_cost_prints_every_figure(tmp_path):
    figures, result = run_bench("cost", tmp_path)
    names = []
    for pins in ("50", "500"):
        for phase in ("pinned", "new"):
            key = f"{phase}@{pins}"
            names += [f"round_trips_per_request@{key}", f"script_calls_per_request@{key}",
                      f"redis_commands_per_request@{key}", f"evalsha_usec_per_call@{key}",
                      f"extproc_cpu_ms_per_request@{key}", f"requests_per_extproc_core_s@{key}"]
            # the hot path: the fused get_pin + admission, then the release
            names += [f"script_calls_per_request@{key}:{script}" for script in ("get_pin_and_admit", "release")]
        names += [f"script_server_us_per_call@{pins}:{script}"
                  for script in ("get_pin", "get_pin_and_admit/pinned", "renew", "release", "admit_pinned",
                                 "get_pin_and_admit/new_pin", "release_new_pin", "cas_repin", "admit_unpinned",
                                 "admit_without_pin", "adopt")]
    assert_numbers(figures, names)
    for run in result["runs"]:
        assert run["preloaded"]["pins"] >= run["pins"]
        assert run["preloaded"]["leases"] == 100
        assert run["script_calls_per_request"] >= 2  # at least an admission and a release
        assert run["trace"]["scripts_per_request"]["get_pin_and_admit"] == 1  # one admission per request


def test_replay_prints_every_figure(tmp_path):
    args = []
    if not default_trace_path().exists():
        args = ["--trace", str(write_small_trace(tmp_path / "trace.jsonl"))]
    figures, result = run_bench("replay", tmp_path, *args)
    names = ["oracle_reused_tokens", "oracle_share_of_prompt_tokens"]
    measured = [p["policy"] for p in result["policies"]]
    assert set(measured) | set(result["skipped_policies"]) == set(POLICIES)
    assert set(result["skipped_policies"]) <= {peer.name for peer in PEERS}
    for policy in measured:
        names += [f"{key}@{policy}" for key in (
            "reuse_share_of_oracle", "own_reuse_share_of_oracle", "third_party_requests", "third_party_decided",
            "needless_offloads", "breaches", "worst_excess", "errors", "latency_p50_ms", "latency_p90_ms",
            "latency_p99_ms", "ttft_p50_ms", "ttft_p99_ms", "queued_requests", "reuse_lost_moved_share_of_oracle",
            "reuse_lost_repinned_elsewhere_share_of_oracle", "third_party_share", "third_party_with_own_slot_within_1s",
            "third_party_with_own_slot_within_2s")]
    names += [f"queue_{key}@router_queue" for key in ("offloads_avoided", "timed_out", "shed")]  # the admission queue on
    assert_numbers(figures, names)
    for policy in result["policies"]:
        assert policy["ok"] > 0
        assert policy["in_flight_samples"]["iris-1"]
    assert report_again("replay", tmp_path) == set(figures)


@pytest.mark.skipif(not (Path(sys.executable).parent / "py-spy").exists() and not shutil.which("py-spy"),
                    reason="py-spy (the bench extra) is not installed")
def test_profile_prints_areas(tmp_path):
    figures, result = run_bench("profile", tmp_path)
    assert_numbers(figures, ["profile_samples", "extproc_cpu_ms_per_request", "requests_per_extproc_core_s"])
    assert result["thread_cpu_ms_per_request"]
    assert result["self"] and result["areas"]


def write_small_trace(path: Path) -> Path:
    """A few conversations in the trace's format, for a checkout without ../shared."""
    rows = []
    for i in range(40):
        conversation = i % 10
        turn = i // 10
        blocks = [0, 100 + conversation] + [1000 + conversation * 10 + t for t in range(turn + 1)]
        rows.append({"timestamp": i * 100, "input_length": 512 * len(blocks), "output_length": 64, "hash_ids": blocks})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_model_rename_prints_every_figure(tmp_path):
    """The answers were checked to name the client's model (the bench raises otherwise); the
    rewrite costs the messages it should: one more for JSON, at least one more for a stream."""
    figures, result = run_bench("model_rename", tmp_path)
    names = [f"rename_{kind}_{what}" for kind in ("json", "stream") for what in ("extproc_ms_per_request", "envoy_ms_per_request", "extra_messages")]
    assert_numbers(figures, names + ["rename_stream_extproc_us_per_message"])
    phases = result["phases"]
    assert phases["json_plain"]["messages_per_request"] == phases["stream_plain"]["messages_per_request"] == 3
    assert phases["json_renamed"]["messages_per_request"] == 4 and phases["stream_renamed"]["messages_per_request"] > 4
    assert set(names) <= report_again("model_rename", tmp_path)


def test_oracle_counts_leading_blocks_seen_before():
    def request(*blocks):
        return TraceRequest(0.0, "u", tuple(blocks), 1, b"")

    requests = [request(0, 1, 2), request(0, 1, 3), request(0, 5, 2), request(0, 1, 2, 4)]
    # second: 0,1 hit; third: 0 hits (2 follows 5, a new prefix); fourth: 0,1,2 hit.
    assert oracle_reused_blocks(requests) == 2 + 1 + 3


def test_messages_of_one_conversation_share_their_leading_messages():
    first, later = messages_for((0, 7, 8), 4), messages_for((0, 7, 8, 9), 4)
    assert later[:3] == first
    assert [m["role"] for m in later] == ["system", "user", "assistant", "user"]
    assert all(len(m["content"].split()) == 4 for m in later)


def test_plain_envoy_has_no_ext_proc_and_routes_to_the_target():
    bootstrap = plain_envoy_bootstrap(1, 2, {"iris-1": 3}, target_cluster="pool",
                                      extra_clusters=[pool_cluster("pool", [4, 5], "RING_HASH")],
                                      hash_header="x-user-id")
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert [f["name"] for f in manager["http_filters"]] == ["envoy.filters.http.router"]
    route = manager["route_config"]["virtual_hosts"][0]["routes"][-1]["route"]
    assert route["cluster"] == "pool"
    assert route["hash_policy"] == [{"header": {"header_name": "x-user-id"}}]


def test_percentile_interpolates():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_a_peer_that_is_not_installed_is_reported_not_started():
    missing = Peer("nothing", "no-such-router-program", "round_robin", "warn")
    assert "no-such-router-program" in unavailable(missing)


REAL_ENGINE_FIGURES = ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "errors", "third_party_share", "engine_cache_share",
                       "engine_cache_share_of_oracle", "cold_requests", "requests_per_second", "output_tokens_per_second", "peak_per_engine",
                       "sessions_moved", "engines_per_group", "engines_cpu_cores", "other_cpu_cores")


def needs_llama_server():
    from irislab.engines import llama_server_binary, model_path

    if llama_server_binary() is None or not model_path().is_file():
        pytest.skip("llama-server or its model is not built: python -m irislab.engines build")


def check_real_engine_run(figures: dict[str, str], result: dict, fronts: list[str]) -> None:
    """Every front end named is measured or skipped with its reason, prints every figure, and
    served every request of the workload (at most one error, a peer's: through Envoy an engine's
    reset connection no longer costs a request, issue 30 item 6)."""
    from bench.real_engines import front_unavailable

    measured = [run["front"] for run in result["runs"]]
    assert set(measured) | set(result["skipped"]) == set(fronts)
    assert {front: front_unavailable(front) for front in result["skipped"]} == result["skipped"]
    assert_numbers(figures, ["oracle_share", *(f"{name}:{front}" for front in measured for name in REAL_ENGINE_FIGURES)])
    assert 0 < result["oracle"]["share"] < 1
    for run in result["runs"]:
        assert run["requests"] == result["requests"] and run["errors"] <= 1, run
        if run["front"].startswith(("iris", "round_robin")):  # Envoy sends no request on a connection the engine closes (issue 30 item 6)
            assert run["errors"] == 0, run
        carried = sum(run["spread"]["requests_per_engine"].values())  # a peer's retry is carried twice
        assert carried >= run["requests"] - run["errors"] - run["third_party_requests"], run
        assert run["spread"]["sessions_seen"] == result["sessions"], run


def test_real_engines_prints_every_figure(tmp_path):
    """bench.real_engines on its tiny chat workload: llama-server engines (built by `./dev test`)
    behind the gateway and plain Envoy; `iris_pick` is measured or skipped with its reason."""
    needs_llama_server()
    fronts = ["iris_hash", "iris_pick", "round_robin"]
    figures, result = run_bench("real_engines", tmp_path, "--fronts", *fronts, timeout=600)
    check_real_engine_run(figures, result, fronts)
    assert {"iris_hash", "round_robin"} <= {run["front"] for run in result["runs"]}
    assert result["workload"] == "chat" and result["requests"] == 4


def test_real_engines_shared_prefix_groups(tmp_path):
    """The shared-prefix workload, tiny: 2 groups x 2 users x 2 turns through the gateway as an
    operator runs it (limits, queue, a third party) and a peer where one is installed; every
    request is attributed to an engine or to the third party, and every group to its engines."""
    needs_llama_server()
    fronts = ["iris_hash_operator", "vllm_sticky_least_loaded"]
    figures, result = run_bench("real_engines", tmp_path, "--workload", "groups", "--fronts", *fronts, timeout=600)
    check_real_engine_run(figures, result, fronts)
    assert result["workload"] == "groups" and result["requests"] == 8 and result["sessions"] == 4
    for run in result["runs"]:
        assert set(run["spread"]["engines_per_group"]) <= {"group0", "group1"}
        assert 1 <= run["spread"]["engines_per_group_mean"] <= 2


def test_shared_prefix_groups_are_deterministic_and_interleaved():
    from bench.real_engines import oracle_share, shared_prefix_groups

    def build(seed):
        return shared_prefix_groups(list(range(1000)), groups=3, users=2, turns=3, prefix_blocks=4, words=5, user_words=3, seed=seed)

    sessions = build(7)
    assert sessions == build(7) and sessions != build(8)
    assert [s[0].session.split("-")[1] for s in sessions] == ["user0"] * 3 + ["user1"] * 3  # every group's first user first
    for session in sessions:
        group = [s for s in sessions if s[0].group == session[0].group]
        assert all(s[0].messages[0] == session[0].messages[0] for s in group)  # one shared prefix per group
        for earlier, later in zip(session, session[1:], strict=False):
            assert later.messages[:len(earlier.messages)] == earlier.messages  # a turn repeats the earlier ones
    # The oracle computes each group's prefix once, and each session's messages after it once
    # (those of its last turn, which repeats the earlier ones).
    prefixes = {s[0].messages[0]["content"] for s in sessions}
    computed = sum(map(len, prefixes)) + sum(len(m["content"]) for s in sessions for m in s[-1].messages[1:])
    oracle = oracle_share(sessions)
    assert len(prefixes) == 3 and oracle["computed_chars"] == computed
    assert oracle["cold_requests"] == 3  # each group's first request computes its prefix; the rest meet it
    assert oracle["chars"] == sum(len(m["content"]) for s in sessions for t in s for m in t.messages)


def test_real_engines_with_aiperf_where_it_is_not_installed_skips_every_front_with_the_reason(tmp_path):
    """`--client aiperf` without the program: each front end is skipped, saying how to install it."""
    figures, result = run_bench("real_engines", tmp_path, "--workload", "groups", "--client", "aiperf",
                                "--aiperf", str(tmp_path / "no-aiperf"), "--fronts", "iris_hash", "round_robin")
    assert result["runs"] == [] and set(result["skipped"]) == {"iris_hash", "round_robin"}
    assert all("aiperf==0.13.0" in why for why in result["skipped"].values())
    assert "oracle_share" in figures


def test_aiperf_is_sized_as_the_groups_workload():
    from bench.real_engines import aiperf_argv, parse_args

    args = parse_args(["--workload", "groups", "--groups", "5", "--users", "3", "--turns", "2", "--clients", "7"])
    argv = aiperf_argv(args, "http://127.0.0.1:1", Path("/tmp/out"))
    flags = {flag: value for flag, value in zip(argv, argv[1:], strict=False) if flag.startswith("--")}
    assert argv[1] == "profile" and "--streaming" in argv
    assert flags["--num-prefix-prompts"] == "5" and flags["--conversation-num"] == "15"
    assert flags["--conversation-turn-mean"] == "2" and flags["--concurrency"] == "7"
    assert flags["--prefix-prompt-length"] == str(args.prefix_blocks * args.words_per_block)


def test_the_oracle_in_blocks_of_text_finds_a_prefix_inside_one_message():
    """aiperf puts its prefix and the user's text in one message: only blocks of text see the share."""
    from bench.real_engines import Turn, oracle_share

    prefix = "p" * 640
    sessions = [[Turn(f"s{i}", [{"role": "user", "content": prefix + f" question {i}"}])] for i in range(4)]
    assert oracle_share(sessions)["share"] == 0.0
    by_text = oracle_share(sessions, block_chars=64)
    assert 0.7 < by_text["share"] < 1 and by_text["chars"] == sum(len("user\0" + t[0].messages[0]["content"] + "\0") for t in sessions)


@pytest.mark.parametrize("front", ["gateway", "envoy"])
def test_connection_resets_prints_its_figures(front, tmp_path):
    """bench.connection_resets on its tiny workload (one llama-server): every request answered by
    the engine, none reset."""
    figures, result = run_bench("connection_resets", tmp_path, "--front", front, timeout=600)
    assert (figures["answered_by_engines"], figures["resets"], figures["closed_under_request"]) == ("24", "0", "0"), result


@pytest.mark.parametrize("front", ["iris_hash", "iris_hash_operator", "iris_pick", "iris_pick_operator"])
def test_real_engines_gateway_configs_are_valid_and_say_their_affinity(front):
    """Each gateway front of bench.real_engines parses, with the affinity its name says and, as an
    operator runs it, each engine capped at its slots where the router picks."""
    from bench.real_engines import MODEL_NAME, iris_config
    from extproc.config import parse_config

    urls = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    pool = parse_config(iris_config(front, urls, parallel=2, queue_wait_ms=2000)).providers[0]
    assert pool.session_affinity.value == ("pick" if "pick" in front else "session_hash")
    assert pool.models[MODEL_NAME].max_in_flight_per_endpoint == (2 if front == "iris_pick_operator" else None)
