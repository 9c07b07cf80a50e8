"""`openinfer` command line (also `python -m openinfer`): generate, serve, router, worker, simulate, deploy (render,
check), bench (offline, serve, soak, spec, structured)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from openinfer.entrypoints.cli_args import add_engine_args, as_flags, engine_fields, engine_options


def _make_llm(args):
    from openinfer import LLM

    return LLM(**engine_options(args))


def cmd_generate(args) -> int:
    from openinfer import SamplingParams

    so = None
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{"):        # a file holding the schema
            with open(text) as f:
                text = f.read()
        so = {"json": text}
    elif args.json_object:
        so = {"json_object": True}
    elif args.regex is not None:
        so = {"regex": args.regex}
    elif args.grammar is not None:
        with open(args.grammar) as f:
            so = {"grammar": f.read()}
    elif args.choice is not None:
        so = {"choice": args.choice}
    try:
        sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed, structured_outputs=so)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    llm = _make_llm(args)
    start = time.perf_counter()
    if args.raw or not (llm.tokenizer.chat_template or llm.tokenizer.is_deepseek):
        outs = llm.generate(args.prompts, sp, use_tqdm=len(args.prompts) > 1)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], sp,
                        use_tqdm=len(args.prompts) > 1)
    elapsed = time.perf_counter() - start
    for prompt, o in zip(args.prompts, outs):
        print(f"### {prompt}\n{o.outputs[0].text.strip()}\n")
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_cached = sum(o.num_cached_tokens for o in outs)
    print(f"[{len(outs)} prompt(s): {sum(len(o.prompt_token_ids) for o in outs)} prompt tokens "
          f"({n_cached} cached), {n_out} generated tokens in {elapsed:.2f}s = {n_out / elapsed:.1f} tok/s "
          f"on {llm.config.device}]")
    from openinfer.models.registry import tiny_models

    if args.model in tiny_models():
        print(f"[{args.model} has random weights: the text above is noise; it exists for tests and demos]")
    return 0


def cmd_worker(args) -> int:
    """Ranks of an engine whose front end runs on another host: one process per rank in --ranks, each
    connected to the front end, which sends it the engine config. Runs until its workers exit (the front end's
    shutdown ends them); SIGTERM or Ctrl-C stops them."""
    import multiprocessing as mp
    import multiprocessing.connection as mpc
    import os
    import signal

    from openinfer.config import parse_host_port
    from openinfer.executor.worker import remote_worker_main

    address = parse_host_port(args.connect, "--connect")
    try:
        ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--ranks must be comma-separated rank numbers, got {args.ranks!r}") from None
    if not ranks or len(set(ranks)) != len(ranks) or min(ranks) < 1:
        raise ValueError(f"--ranks must list distinct ranks >= 1 (rank 0 runs with the front end), got {args.ranks!r}")
    authkey = args.authkey or os.environ.get("OPENINFER_WORKER_AUTHKEY")
    if not authkey:
        raise ValueError("an authkey is required: set OPENINFER_WORKER_AUTHKEY (or --authkey), the same as the "
                         "front end's")
    if args.device not in (None, "cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {args.device!r}")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=remote_worker_main,
                         args=(address, authkey.encode(), rank, i, len(ranks), args.device, args.connect_timeout),
                         name=f"openinfer-rank{rank}", daemon=True)
             for i, rank in enumerate(ranks)]

    stopped_by = [signal.SIGINT]

    def stop(signum, frame):
        stopped_by[0] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        for p in procs:
            p.start()
        print(f"openinfer worker: ranks {ranks} connecting to {args.connect} (pids "
              f"{[p.pid for p in procs]})", file=sys.stderr, flush=True)
        alive = list(procs)
        while alive:
            mpc.wait([p.sentinel for p in alive])
            alive = [p for p in alive if p.exitcode is None and p.is_alive()]
    except KeyboardInterrupt:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        return 128 + stopped_by[0]
    codes = [p.exitcode for p in procs]
    bad = {r: c for r, c in zip(ranks, codes) if c != 0}
    if bad:
        print(f"openinfer worker: rank(s) exited with codes {bad}", file=sys.stderr)
        return 1
    return 0


def cmd_calibrate(args) -> int:
    """Fit (or refit) the step cost model of this model, device and dtype; print it and where it is saved."""
    from openinfer.engine.cost_model import load_or_calibrate

    llm = _make_llm(args)
    model, path = load_or_calibrate(llm.engine, refit=True)
    saved = json.loads(path.read_text())
    print(json.dumps({"path": str(path), "coefficients_ms": saved["coefficients_ms"],
                      "rel_rms_error": saved["rel_rms_error"], "num_samples": saved["num_samples"]}, indent=1))
    llm.shutdown()
    return 0


def cmd_bench_offline(args) -> int:
    from openinfer.benchmarks.offline import OfflineWorkload, parse_range, run_offline

    workload = OfflineWorkload(args.num_requests, parse_range(args.input_len), parse_range(args.output_len), args.seed)
    llm = _make_llm(args)
    result = run_offline(llm, workload)
    result.update(model=args.model, device=llm.config.device, dtype=str(llm.config.torch_dtype),
                  max_num_seqs=args.max_num_seqs)
    print(f"{args.num_requests} requests, "
          f"{result['input_tokens']} prompt + {result['output_tokens']} output tokens in {result['elapsed_s']:.2f}s: "
          f"{result['output_tok_per_s']:.1f} output tok/s, {result['total_tok_per_s']:.1f} total tok/s, "
          f"{result['requests_per_s']:.2f} req/s")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def cmd_serve(args) -> int:
    from openinfer.serving.api_server import ServerConfig, run_server

    config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                          served_model_name=args.served_model_name, max_waiting=args.max_waiting,
                          request_timeout_s=args.request_timeout, role=args.role,
                          api_server_count=args.api_server_count, encoders=args.encoders,
                          encoder_timeout_s=args.encoder_timeout, encoder_health_interval_s=args.encoder_health_interval,
                          timeout_keep_alive_s=args.timeout_keep_alive)
    if args.role == "encoder":
        return _serve_encoder(args, config)
    if args.role == "prefill" and not (args.kv_store_dir or args.kv_store_url):
        raise ValueError("--role prefill hands its KV blocks over through a shared prefix-KV store: give it "
                         "--kv-store-dir (a directory the decode instances share) or --kv-store-url")
    from openinfer.config import EngineConfig
    from openinfer.executor.engine_core import EngineCoreClient

    engine_config = EngineConfig.from_kwargs(**engine_options(args))
    if config.api_server_count > 1:       # API-server processes over one engine core, this process their supervisor
        from openinfer.serving.api_servers import run_api_servers

        return run_api_servers(engine_config, config, args.model)
    # the engine core in its own process: the HTTP side and the engine loop never share an interpreter
    core = EngineCoreClient(engine_config)
    try:
        core.touch_cache_pages()
        return run_server(core, config, args.model)
    finally:
        core.shutdown()


def _serve_encoder(args, config) -> int:
    """`serve --role encoder`: the vision tower alone (serving/encoder_server.py); engine options it would not
    read are refused by name."""
    from openinfer.config import EngineConfig
    from openinfer.models.registry import resolve
    from openinfer.serving.encoder_server import ENCODER_ENGINE_OPTIONS, run_encoder_server

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")
    ignored = [flag(f.name) for f in engine_fields()
               if getattr(args, f.name) != f.default and f.name not in ENCODER_ENGINE_OPTIONS]
    if args.request_timeout is not None:
        ignored.append("--request-timeout")
    if ignored:
        raise ValueError(f"--role encoder runs the vision tower alone: it reads "
                         f"{', '.join(sorted(map(flag, ENCODER_ENGINE_OPTIONS)))} and none of {', '.join(ignored)}")
    engine_config = EngineConfig.from_kwargs(**engine_options(args))
    return run_encoder_server(engine_config, config, resolve(engine_config))


def cmd_router(args) -> int:
    from openinfer.serving.router import RouterConfig, run_router

    config = RouterConfig(prefill=args.prefill, decode=args.decode, both=args.both, host=args.host, port=args.port,
                          health_interval_s=args.health_interval, health_timeout_s=args.health_timeout,
                          health_failures=args.health_failures, upstream_timeout_s=args.upstream_timeout,
                          timeout_keep_alive_s=args.timeout_keep_alive)
    run_router(config)
    return 0


def cmd_bench_serve(args) -> int:
    from openinfer.benchmarks.serve import ServeBenchConfig, run_offline_reference, run_serve_bench

    cfg = ServeBenchConfig(base_url=args.base_url, endpoint=args.endpoint, model=args.model_name,
                           num_prompts=args.num_prompts, max_concurrency=args.max_concurrency,
                           request_rate=args.request_rate, input_len=args.input_len, output_len=args.output_len,
                           seed=args.seed, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                           api_key=args.api_key, ignore_eos=args.ignore_eos, prompt_mode=args.prompt_mode,
                           image_size=args.image_size)
    if args.api_server_count != 1 and not args.compare_offline:
        raise ValueError("--api-server-count is for the server --compare-offline starts (a running server at "
                         "--base-url has its own)")
    if not args.compare_offline:
        result = run_serve_bench(cfg)
    else:
        # the engine alone first (it needs the device to itself), then a server of the same engine options,
        # started here, under the same prompts: the server's overhead as a ratio, in one call
        import tempfile

        from openinfer.benchmarks.soak import serve_process

        llm = _make_llm(args)
        offline = run_offline_reference(llm, cfg)
        llm.shutdown()
        del llm
        log = tempfile.mkstemp(prefix="openinfer-bench-serve-", suffix=".log")[1]
        server_flags = ["--api-server-count", str(args.api_server_count)] if args.api_server_count != 1 else []
        with serve_process(as_flags(args) + server_flags, log) as (base_url, _):
            cfg.base_url = base_url
            result = run_serve_bench(cfg)
        result["api_server_count"] = args.api_server_count
        result["offline"] = offline
        result["server_over_offline"] = result["output_throughput"] / offline["output_throughput"]
        result["server_log"] = log
        print(f"  offline  {offline['output_throughput']:.1f} output tok/s over the same prompts: the server gives "
              f"{result['server_over_offline']:.0%} of it")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def cmd_bench_sweep(args) -> int:
    import tempfile

    from openinfer.benchmarks.soak import serve_process
    from openinfer.benchmarks.sweep import SweepConfig, sweep, with_levels, write

    cfg = with_levels(SweepConfig(input_len=args.input_len, output_len=args.output_len,
                                  prompts_per_stream=args.prompts_per_stream, num_gpus=args.num_gpus,
                                  label=args.label, endpoint=args.endpoint, seed=args.seed), args.concurrency)
    previous = [json.loads(open(p).read()) for p in args.previous]
    if args.base_url is not None:
        result = sweep(args.base_url, cfg, args.model_name)
    else:   # a server of the engine options given, started here once for every level
        log = tempfile.mkstemp(prefix="openinfer-sweep-server-", suffix=".log")[1]
        with serve_process(as_flags(args), log) as (base_url, _):
            result = sweep(base_url, cfg, args.model_name)
        result["server_args"], result["server_log"] = as_flags(args), log
    for path in write(result, args.out, args.name, previous):
        print(f"wrote {path}")
    return 0 if all(p["failed"] == 0 for p in result["points"]) else 1


def cmd_bench_spec(args) -> int:
    from openinfer.benchmarks.spec import cli_main

    return cli_main(args)


def cmd_bench_structured(args) -> int:
    from openinfer.benchmarks.structured import cli_main

    return cli_main(args)


def cmd_bench_prefix(args) -> int:
    from openinfer.benchmarks.prefix import cli_main

    return cli_main(args)


def cmd_bench_soak(args) -> int:
    import tempfile

    from openinfer.benchmarks.soak import SoakConfig, run_soak, serve_process

    cfg = SoakConfig(base_url=args.base_url, clients=args.clients, duration_s=args.duration,
                     cut_requests=args.cut_requests, fuzz_bodies=args.fuzz_bodies, max_tokens=args.max_tokens,
                     rss_pid=args.server_pid, rss_interval_s=args.rss_interval, seed=args.seed)
    if args.base_url is not None:
        result = run_soak(cfg)
    else:   # start our own server, so RSS is measured from its first moment
        log = args.server_log or tempfile.mkstemp(prefix="openinfer-soak-server-", suffix=".log")[1]
        with serve_process(as_flags(args), log) as (base_url, proc):
            cfg.base_url, cfg.rss_pid = base_url, proc.pid
            result = run_soak(cfg)
        result.update(server_args=as_flags(args), server_exit_code=proc.returncode,
                      server_log=log)
        print(f"  server stopped with exit code {proc.returncode} (log: {log})")
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    ok = (result["errors"] == 0 and result["server_5xx"] == 0 and result["leaked_blocks"] == 0
          and result.get("server_exit_code", 0) == 0)
    return 0 if ok else 1


def _token_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def cmd_deploy_render(args) -> int:
    """Render the Kubernetes resources from a values file; refuses to write resources that fail the check."""
    from openinfer.cluster import kubernetes as k8s

    values = k8s.load_values(args.values, args.set)
    text = k8s.render(values)
    problems = k8s.check(k8s.resources_of(text), external_claims=tuple(filter(None, [values.model_claim])))
    if problems:
        raise ValueError("the rendered resources fail their check:\n  " + "\n  ".join(problems))
    header = (f"# Generated by `openinfer deploy render {args.values}"
              + "".join(f" --set {s}" for s in args.set) + "` from openinfer/cluster/kubernetes.yaml.j2: edit the "
              "values, not this file.\n")
    if args.output:
        Path(args.output).write_text(header + text)
    else:
        sys.stdout.write(header + text)
    return 0


def cmd_deploy_check(args) -> int:
    """Check Kubernetes resource files (rendered, maybe edited since): schemas and cross references."""
    from openinfer.cluster import kubernetes as k8s

    resources = [res for path in args.files for res in k8s.resources_of(Path(path).read_text())]
    problems = k8s.check(resources, external_claims=tuple(args.claim))
    for problem in problems:
        print(problem)
    print(f"{len(resources)} resources: " + (f"{len(problems)} problem(s)" if problems else "ok"),
          file=sys.stderr)
    return 1 if problems else 0


def cmd_simulate(args) -> int:
    import datetime
    import os
    import subprocess

    from openinfer.cluster import simulator as sim
    from openinfer.cluster.autoscale import AutoscaleConfig, PoolBounds

    workload = sim.WorkloadConfig(
        seed=args.seed, duration_s=args.duration, day_s=args.day or args.duration, peak_rate=args.peak_rate,
        trough_fraction=args.trough_fraction, long_fraction=args.long_fraction, turns=args.turns,
        short_prompt_tokens=args.short_prompt, long_prompt_tokens=args.long_prompt, output_tokens=args.output_len)
    common = dict(slo_ttft_s=args.slo_ttft_ms / 1e3, slo_tpot_s=args.slo_tpot_ms / 1e3,
                  decode_max_seqs=args.decode_max_seqs, sample_interval_s=args.sample_interval)
    static = sim.ClusterConfig(prefill_instances=args.prefill, decode_instances=args.decode, **common)
    policy = AutoscaleConfig(
        interval_s=args.interval, target_utilization=args.target_utilization, redundancy=args.redundancy,
        ready_pool_size=args.ready_pool, over_provision_fraction=args.over_provision, grace_period_s=args.grace,
        cold_start_s=args.cold_start,
        prefill=PoolBounds(args.min_prefill, args.max_prefill, args.max_add, args.max_remove),
        decode=PoolBounds(args.min_decode, args.max_decode, args.max_add, args.max_remove))
    autoscaled = sim.ClusterConfig(prefill_instances=args.min_prefill, decode_instances=args.min_decode,
                                   autoscale=policy, **common)
    clusters = {"static": static, "autoscale": autoscaled} if args.compare else \
        {"autoscale" if args.autoscale else "static": autoscaled if args.autoscale else static}
    runs = {name: sim.simulate(workload, cluster) for name, cluster in clusters.items()}
    keys = ("requests", "dropped", "slo_attainment", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99",
            "queue_ms_p99", "gpu_hours_prefill", "gpu_hours_decode", "gpu_hours_ready_pool", "gpu_hours_total",
            "peak_prefill_gpus", "peak_decode_gpus", "pd_ratio_gpu_hours", "migrated_requests")
    print(f"{'':22}" + "".join(f"{name:>14}" for name in runs))
    for k in keys:
        print(f"{k:22}" + "".join(f"{str(r.summary[k]):>14}" for r in runs.values()))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = None
        payload = sim.results_payload(workload, clusters, runs, commit, datetime.date.today().isoformat())
        path = os.path.join(args.out, f"{args.name}.json")
        with open(path, "w") as f:
            json.dump(payload, f, indent=1)
        written = [path] + sim.write_plots(os.path.join(args.out, args.name), runs)
        print("wrote " + ", ".join(written))
    return 0


def _simulate_args(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("trace")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--duration", type=float, default=3600.0, metavar="SECONDS", help="conversations start within it")
    t.add_argument("--day", type=float, default=None, metavar="SECONDS",
                   help="one diurnal period (default: --duration, a day compressed into it; 86400: a real day)")
    t.add_argument("--peak-rate", type=float, default=10.0, help="requests/s at the daily peak")
    t.add_argument("--trough-fraction", type=float, default=0.15, help="the trough's rate over the peak's")
    t.add_argument("--long-fraction", type=float, default=0.2, help="conversations opening with a long prompt")
    t.add_argument("--turns", type=int, default=3, help="mean turns per conversation")
    t.add_argument("--short-prompt", type=_token_range, default=(256, 2048), metavar="LO:HI")
    t.add_argument("--long-prompt", type=_token_range, default=(8192, 32768), metavar="LO:HI")
    t.add_argument("--output-len", type=_token_range, default=(64, 512), metavar="LO:HI")
    c = p.add_argument_group("cluster and policy")
    c.add_argument("--prefill", type=int, default=4, help="static prefill instances (one GPU each)")
    c.add_argument("--decode", type=int, default=4, help="static decode instances (one GPU each)")
    mode = c.add_mutually_exclusive_group()
    mode.add_argument("--autoscale", action="store_true", help="the autoscaler instead of static counts")
    mode.add_argument("--compare", action="store_true", help="static and autoscaled on the same trace")
    c.add_argument("--min-prefill", type=int, default=1)
    c.add_argument("--max-prefill", type=int, default=64)
    c.add_argument("--min-decode", type=int, default=1)
    c.add_argument("--max-decode", type=int, default=64)
    c.add_argument("--interval", type=float, default=60.0, metavar="SECONDS", help="autoscaler decision interval")
    c.add_argument("--target-utilization", type=float, default=0.7)
    c.add_argument("--max-add", type=int, default=4, help="instances added per pool per interval, at most")
    c.add_argument("--max-remove", type=int, default=1, help="instances removed per pool per interval, at most")
    c.add_argument("--redundancy", choices=["ready_pool", "over_provision"], default="ready_pool")
    c.add_argument("--ready-pool", type=int, default=2, help="ready machines kept unassigned (ready_pool)")
    c.add_argument("--over-provision", type=float, default=0.2, help="extra share online (over_provision)")
    c.add_argument("--grace", type=float, default=60.0, metavar="SECONDS", help="decode drain before migration")
    c.add_argument("--cold-start", type=float, default=180.0, metavar="SECONDS")
    c.add_argument("--decode-max-seqs", type=int, default=256)
    c.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    c.add_argument("--slo-tpot-ms", type=float, default=50.0)
    o = p.add_argument_group("output")
    o.add_argument("--sample-interval", type=float, default=60.0, metavar="SECONDS", help="timeline resolution")
    o.add_argument("--out", default=None, metavar="DIR", help="write NAME.json, NAME_gpus.png, NAME_latency.png")
    o.add_argument("--name", default="sim", help="file name stem under --out")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="openinfer", description="openinfer inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="answer prompts (chat template applied unless --raw)")
    add_engine_args(gen, taken={"--seed"})
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--raw", action="store_true", help="send prompts as-is, without the chat template")
    so = gen.add_mutually_exclusive_group()   # structured output (docs/structured_output.md)
    so.add_argument("--json-schema", default=None, metavar="SCHEMA|FILE", help="answer with JSON matching this schema")
    so.add_argument("--json-object", action="store_true", help="answer with a JSON object")
    so.add_argument("--regex", default=None, help="answer with text matching this regular expression")
    so.add_argument("--grammar", default=None, metavar="FILE", help="answer in the language of this EBNF grammar")
    so.add_argument("--choice", action="append", default=None, help="answer with one of these strings (repeat it)")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="the model (as vLLM's `serve MODEL`; --model also works)")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require this key (Authorization: Bearer / x-api-key)")
    serve.add_argument("--served-model-name", default=None, help="model name clients use (default: --model)")
    serve.add_argument("--max-waiting", type=int, default=None, help="queue limit; beyond it requests get 429")
    serve.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                       help="abort a request still unfinished this long after it arrived (408)")
    serve.add_argument("--role", choices=["both", "prefill", "decode", "encoder"], default="both",
                       help="prefill/decode disaggregation behind `openinfer router` (docs/serving.md): prefill "
                            "computes prompts into the shared prefix-KV store (needs --kv-store-dir or "
                            "--kv-store-url) and answers one token; decode serves requests whole, finding their "
                            "prompts' full blocks in the store; both: whole requests, no store needed; encoder: "
                            "the model's vision tower alone, answering POST /v1/encode for the instances that list "
                            "it in --encoder (EPD, docs/vision.md)")
    serve.add_argument("--api-server-count", type=int, default=1, metavar="N",
                       help="API-server processes (HTTP, tokenization, SSE framing) sharing the port over the one "
                            "engine core, as vLLM's; 1: one process beside the core. More when one process cannot "
                            "frame the streams' chunks as fast as the engine makes them (docs/serving.md)")
    _add_keep_alive_arg(serve)
    serve.add_argument("--encoder", dest="encoders", nargs="+", action="extend", default=[], metavar="URL",
                       help="vision-encoder instances (--role encoder) to send each request's images to, the one "
                            "with the fewest patches in flight first; images are encoded here when none answers")
    serve.add_argument("--encoder-timeout", type=float, default=60.0, metavar="SECONDS",
                       help="longest silence from an encoder instance on one image before trying another")
    serve.add_argument("--encoder-health-interval", type=float, default=2.0, metavar="SECONDS",
                       help="how often the encoder instances' /load is read")
    serve.set_defaults(func=cmd_serve)

    router = sub.add_parser("router", help="one OpenAI/Anthropic-compatible front door over prefill, decode and "
                                           "whole-request instances: balancers, health checks, retries",
                            description="Route requests over `openinfer serve` instances (docs/serving.md). With "
                                        "--prefill instances, each request is first computed there (one output "
                                        "token, its prompt's KV left in the shared prefix-KV store), then sent "
                                        "as is to a --decode (or --both) instance, whose answer (streams "
                                        "included) goes back to the client.")
    for role in ("prefill", "decode", "both"):
        router.add_argument(f"--{role}", nargs="+", action="extend", default=[], metavar="URL",
                            help=f"{role} instance(s), e.g. http://10.0.0.5:8000 (repeatable)")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8080)
    router.add_argument("--health-interval", type=float, default=2.0, metavar="SECONDS",
                        help="how often each instance's /load is read")
    router.add_argument("--health-timeout", type=float, default=2.0, metavar="SECONDS")
    router.add_argument("--health-failures", type=int, default=2,
                        help="failed checks in a row (timeouts, errors) that drain an instance; a refused or "
                             "dropped connection drains it at once")
    router.add_argument("--upstream-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="longest silence from an instance mid-request")
    _add_keep_alive_arg(router)
    router.set_defaults(func=cmd_router)

    cal = sub.add_parser("calibrate", help="fit the step cost model used by --prefill-step-budget-ms (saved in the cache)")
    add_engine_args(cal)
    cal.set_defaults(func=cmd_calibrate)

    worker = sub.add_parser(
        "worker", help="ranks of a multi-host engine, connected to its front end on another host",
        description="Run ranks of an engine whose front end (openinfer serve / LLM(...) with --num-local-ranks "
                    "and --worker-listen-address) is on another host. Each rank connects to the front end, "
                    "authenticates with the shared key and receives the engine config, so no engine options are "
                    "given here. The model path in that config must exist on this host too (the same path, e.g. "
                    "a shared filesystem), and the --distributed-init-method address must be reachable from "
                    "here. Rank i of --ranks uses GPU i of this host. The command exits when its ranks do (the "
                    "front end's shutdown ends them); SIGTERM or Ctrl-C stops them.")
    worker.add_argument("--connect", required=True, metavar="HOST:PORT",
                        help="the front end's --worker-listen-address")
    worker.add_argument("--ranks", required=True, metavar="R1,R2,...", help="the global ranks this host runs")
    worker.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="must match the front end's device (default: the front end's)")
    worker.add_argument("--authkey", default=None,
                        help="shared key (default: the environment variable OPENINFER_WORKER_AUTHKEY)")
    worker.add_argument("--connect-timeout", type=float, default=1800.0, metavar="SECONDS",
                        help="how long to retry while the front end is not listening yet")
    worker.set_defaults(func=cmd_worker)

    simulate = sub.add_parser("simulate", help="discrete-event simulation of a prefill/decode cluster: static P:D "
                                               "vs the autoscaler on a diurnal multi-turn trace (H200 costs)",
                              description="Simulate a P/D cluster (docs/serving.md, Autoscaling) from the fitted "
                                          "H200 step costs: GPUs over time, TTFT/TPOT, SLO attainment, GPU-hours.")
    _simulate_args(simulate)
    simulate.set_defaults(func=cmd_simulate)

    deploy = sub.add_parser("deploy", help="the serving system as Kubernetes resources: render from values, check "
                                           "(docs/deployment.md)")
    deploy_sub = deploy.add_subparsers(dest="deploy_command", required=True)
    render = deploy_sub.add_parser(
        "render", help="render the router, the pools, the KV store and the autoscalers from a values file",
        description="Render Kubernetes resources from a values file (deploy/values.yaml documents the keys) and "
                    "check them as `deploy check` does; nothing is written if the check fails.")
    render.add_argument("values", metavar="VALUES", help="values YAML (e.g. deploy/values.yaml)")
    render.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a value (dotted key, YAML value), e.g. --set pools.decode.replicas=4")
    render.add_argument("-o", "--output", default=None, metavar="FILE", help="write here (default: stdout)")
    render.set_defaults(func=cmd_deploy_render)
    check = deploy_sub.add_parser(
        "check", help="validate resource files offline: Kubernetes schemas and cross references",
        description="Validate every resource against the Kubernetes OpenAPI schemas (kubernetes-validate, strict; "
                    "RayCluster: KubeRay's fields and Kubernetes' pod template schema) and check the references "
                    "between them: selectors, ports, Services, HPA targets, volumes, addresses in arguments. "
                    "Exit 1 if anything is wrong.")
    check.add_argument("files", nargs="+", metavar="FILE")
    check.add_argument("--claim", action="append", default=[], metavar="NAME",
                       help="a PersistentVolumeClaim that exists already (the model's)")
    check.set_defaults(func=cmd_deploy_check)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    off = bench_sub.add_parser("offline", help="offline throughput on random prompts, EOS ignored")
    add_engine_args(off, taken={"--seed"})
    off.add_argument("--num-requests", type=int, default=64)
    off.add_argument("--input-len", default="128", help="N or LO:HI (uniform)")
    off.add_argument("--output-len", default="128", help="N or LO:HI (uniform)")
    off.add_argument("--seed", type=int, default=0)
    off.add_argument("--result-json", default=None)
    off.set_defaults(func=cmd_bench_offline)
    srv = bench_sub.add_parser("serve", help="load a running server; TTFT/TPOT/ITL percentiles and goodput")
    srv.add_argument("--base-url", default="http://127.0.0.1:8000")
    srv.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    srv.add_argument("--model-name", default=None, help="model name to send (default: the server's first model)")
    srv.add_argument("--num-prompts", type=int, default=64)
    load = srv.add_mutually_exclusive_group()
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    srv.add_argument("--input-len", type=int, default=128)
    srv.add_argument("--output-len", type=int, default=128)
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--slo-ttft-ms", type=float, default=None)
    srv.add_argument("--slo-tpot-ms", type=float, default=None)
    srv.add_argument("--api-key", default=None)
    srv.add_argument("--ignore-eos", action="store_true", help="every request runs to --output-len")
    srv.add_argument("--prompt-mode", choices=["text", "image"], default="text",
                     help="image: each chat prompt also carries one generated image of --image-size (a PNG data URL, "
                          "a different one per prompt)")
    srv.add_argument("--image-size", default=None, metavar="WxH", help="the images' size in pixels, e.g. 672x448")
    srv.add_argument("--compare-offline", action="store_true",
                     help="run the same prompts through LLM (the engine alone) first, then start a server with the "
                          "same engine options here and load it: the server's share of the offline throughput, one "
                          "call (--base-url is then the started server's)")
    srv.add_argument("--api-server-count", type=int, default=1, metavar="N",
                     help="with --compare-offline: the started server's API-server processes (serve's option)")
    srv.add_argument("--result-json", default=None)
    add_engine_args(srv, taken={"--seed"})      # --compare-offline: the engine's options
    srv.set_defaults(func=cmd_bench_serve)
    soak = bench_sub.add_parser("soak", help="hold a server under streaming load, cut requests and fuzzed bodies; "
                                             "RSS over time, errors, leaked KV blocks")
    add_engine_args(soak, taken={"--seed"})     # for the server it starts
    soak.add_argument("--base-url", default=None, help="soak a running server instead of starting one")
    soak.add_argument("--server-pid", type=int, default=None, help="with --base-url: its pid, to sample RSS")
    soak.add_argument("--server-log", default=None, help="where the started server writes its log")
    soak.add_argument("--clients", type=int, default=32, help="concurrent streaming clients")
    soak.add_argument("--duration", type=float, default=600, metavar="SECONDS")
    soak.add_argument("--cut-requests", type=int, default=200, help="requests hung up on part-way")
    soak.add_argument("--fuzz-bodies", type=int, default=1000, help="mutated request bodies")
    soak.add_argument("--max-tokens", type=int, default=64, help="per streamed answer (drawn from [N/4, N])")
    soak.add_argument("--rss-interval", type=float, default=5.0, metavar="SECONDS")
    soak.add_argument("--seed", type=int, default=0)
    soak.add_argument("--result-json", default=None)
    soak.set_defaults(func=cmd_bench_soak)
    sw = bench_sub.add_parser("sweep", help="serving sweep over concurrency: output tok/s per GPU vs tok/s per user, "
                                            "JSON + a Pareto PNG (an earlier run's line beside it)")
    sw.add_argument("--base-url", default=None, help="load a running server (default: start one of the engine "
                                                    "options given, once)")
    sw.add_argument("--model-name", default=None, help="model name to send (default: the server's first model)")
    sw.add_argument("--concurrency", default="1,8,32,64,128,256", help="comma list of levels")
    sw.add_argument("--input-len", type=int, default=1024)
    sw.add_argument("--output-len", type=int, default=256)
    sw.add_argument("--prompts-per-stream", type=int, default=2, help="each level sends concurrency x N prompts")
    sw.add_argument("--num-gpus", type=int, default=1, help="the throughput axis is per GPU")
    sw.add_argument("--endpoint", choices=["chat", "completions"], default="completions")
    sw.add_argument("--label", default="openinfer", help="this run's line in the picture")
    sw.add_argument("--previous", action="append", default=[], metavar="JSON",
                    help="an earlier sweep's JSON to draw beside this one (repeatable)")
    sw.add_argument("--seed", type=int, default=0)
    sw.add_argument("--out", default="benchmarks/results", help="directory for NAME.json and NAME.png")
    sw.add_argument("--name", default="sweep")
    add_engine_args(sw, taken={"--seed"})      # the server it starts
    sw.set_defaults(func=cmd_bench_sweep)
    spec = bench_sub.add_parser("spec", help="speculative decoding (ngram prompt lookup) vs none on edit/summary/chat "
                                             "tasks: accept rate, accepted length, tok/s, TPOT over concurrency")
    from openinfer.benchmarks.spec import add_cli_args as _spec_args
    _spec_args(spec)
    spec.set_defaults(func=cmd_bench_spec)
    structured = bench_sub.add_parser("structured", help="structured output (json schema / regex / json object "
                                                         "masks) vs unconstrained: tok/s, TPOT, TTFT, validity, "
                                                         "grammar compile cold vs cached, over concurrency")
    from openinfer.benchmarks.structured import add_cli_args as _structured_args
    _structured_args(structured)
    structured.set_defaults(func=cmd_bench_structured)
    prefix = bench_sub.add_parser("prefix", help="multi-turn shared prefixes: TTFT p50/p99, prefill tokens saved, "
                                                 "no cache vs pool vs a restarted engine's prefix-KV store")
    from openinfer.benchmarks.prefix import add_cli_args as _prefix_args
    _prefix_args(prefix)
    prefix.set_defaults(func=cmd_bench_prefix)
    return parser


def _add_keep_alive_arg(parser) -> None:
    from openinfer.serving.http_server import DEFAULT_KEEP_ALIVE_S

    parser.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_KEEP_ALIVE_S, metavar="SECONDS",
                        help="how long an idle client connection is kept open; longer than clients keep theirs in "
                             "their pools (httpx: 5 s, Go: 90 s), so that no client sends a request on a connection "
                             "the server is closing (a reset) (docs/serving.md)")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None) is not None:      # `serve MODEL`
        flag = getattr(args, "_engine_flags_seen", {}).get("model")
        if flag is not None and flag[1] != args.model_tag:
            parser.error(f"the model is given twice: {args.model_tag!r} and {flag[0]} {flag[1]!r}")
        args.model = args.model_tag
    try:
        return args.func(args)
    except (ValueError, TypeError) as e:
        print(f"openinfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
