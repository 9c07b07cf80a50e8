"""`openinfer bench spec`: speculative decoding (prompt lookup `ngram`, a trained draft head `draft_head`, DeepSeek's
`mtp` and `dspark` heads) vs plain decoding on real tasks.

Tasks (fixed texts in this module, chat template applied through `LLM.chat`, EOS not ignored):

- ``edit``: copy text given in the prompt with small changes -- fix the typos of a paragraph (typos injected
  deterministically into real English paragraphs) or repeat a function from openinfer's own source with it
  renamed. Prompt lookup should pay here: most of the answer is in the prompt.
- ``summarize``: summarise a given paragraph. Some phrases are copied, most are not.
- ``chat``: open-ended questions with nothing to copy.

Modes, all in one process on the same requests: ``none`` (no speculative_config), ``fixed-2`` and ``fixed-4``
(verify every draft), ``confidence-4`` (k=4, DSpark's global budget split by the drafts' confidences, budget =
``--budget-per-seq`` x concurrency).

Concurrency c means: an engine built with ``max_num_seqs=c`` receives all of a cell's requests at once
(``max(c, --min-requests)`` of them), so c requests are in flight while enough remain -- continuous batching, as
a server under c clients would see (not waves of c). One engine per (mode, concurrency), so the confidence
budget can follow c; prefix caching is off so every cell prefills its prompts the same way.

Per (task, temperature, mode, concurrency) it reports the accept rate (accepted / drafted), the mean accepted
length per verify step (accepted drafts per drafting request-step + 1, the spec's "mean accepted length"), drafts
verified per drafting request-step, output tok/s over the cell's wall time, TPOT (per request
(finished - first token) / (output tokens - 1), averaged over requests) and their ratios to ``none`` in the same
run. Greedy outputs with speculation are compared token for token with ``none``'s (prompt lookup is lossless).

Drafting request-steps are counted by wrapping the engine's output processor (the drafts each step verified per
request, `RunnerOutput.drafts`); the engine itself is unchanged.
"""

from __future__ import annotations

import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass

# ---------------------------------------------------------------------------------------------------------------
# Texts. Paragraphs: the lighthouse story of tests/test_gemma3.py (_STORY) split in four, plus four more written for
# this benchmark. Code: functions copied from openinfer's own source (as of this module's commit).

PARAGRAPHS = [
    "The lighthouse keeper on the northern island kept a logbook of every ship that passed. In spring the fishing "
    "boats came first, painted blue and red, their nets heavy with herring. A botanist visiting in June counted "
    "forty-two species of moss on the cliffs below the lamp. She wrote that the soil was thin and acidic, and that "
    "the wind shaped every shrub into a crouch.",
    "The keeper's daughter learned Morse code from an old radio manual and practiced on the lamp at night. Once, "
    "during an October storm, a cargo ship lost power two miles from the rocks. The daughter signalled the "
    "coordinates to the mainland while her father fired flares into the rain. A tugboat from the harbour reached "
    "the ship before dawn and towed it into calmer water.",
    "The shipping company later sent a letter of thanks and a crate of oranges, which the island had never seen. "
    "Years afterwards the lighthouse was automated, and the keeper moved to a small house in the town. He kept the "
    "logbooks on a shelf above the stove and read them aloud to visitors on winter evenings. His daughter became "
    "an engineer and designed radio beacons that are still used along the coast.",
    "Mathematics also mattered on the island: the tide tables were computed by hand every month. Twice a day the "
    "sea rose and fell by about four metres, and the causeway flooded for six hours. Children from the mainland "
    "sometimes walked across at low tide and had to wait for the next one. The school teacher used the tides to "
    "explain the moon, gravity and the rotation of the earth.",
    "Bread is one of the oldest prepared foods. Early farmers ground wild grain between stones, mixed the flour "
    "with water and baked flat cakes on hot rocks. Leavened bread appeared when a dough was left to stand and wild "
    "yeast made it rise, producing a lighter loaf with a sour taste. Bakers learned to keep a piece of each dough "
    "to start the next batch, a habit that survives today in sourdough starters passed between families.",
    "A city library in the nineteenth century was often the only warm and quiet public room a worker could enter "
    "without paying. Many libraries opened reading rooms late into the evening so that people could come after "
    "their shifts. Newspapers were clipped to wooden poles and shared by dozens of readers a day. Librarians kept "
    "careful records of which books were borrowed, and these records now help historians study what ordinary "
    "people read.",
    "Honeybees communicate the location of food with a dance performed on the vertical surface of the comb. A "
    "forager that has found a rich patch of flowers runs a short straight line while waggling her body, then "
    "circles back and repeats it. The angle of the straight run relative to the vertical shows the direction of "
    "the flowers relative to the sun, and the length of the run shows how far away they are.",
    "The first railways were built to carry coal from mines to rivers and ports, and horses pulled the wagons "
    "along wooden rails. Steam locomotives replaced the horses in the early nineteenth century, and within a few "
    "decades passenger lines connected most large towns. Railway companies needed a single time for their "
    "timetables, so local clocks, which had followed the sun, were gradually set to a common standard time.",
]

CODE = [
    ("parse_range", "span",
     'def parse_range(text: str) -> tuple[int, int]:\n'
     '    """\'128\' -> (128, 128); \'100:1024\' -> (100, 1024)."""\n'
     '    lo, _, hi = text.partition(":")\n'
     '    lo_i, hi_i = int(lo), int(hi or lo)\n'
     '    if lo_i < 1 or hi_i < lo_i:\n'
     '        raise ValueError(f"bad length range {text!r}: want N or LO:HI with 1 <= LO <= HI")\n'
     '    return lo_i, hi_i\n'),
    ("_confidences", "match_confidences",
     'def _confidences(toks: np.ndarray, follow: np.ndarray, drafts: list[int]) -> list[float]:\n'
     '    conf = []\n'
     '    alive = follow\n'
     '    for i, d in enumerate(drafts):\n'
     '        alive = alive[alive + i < len(toks)]\n'
     '        agree = alive[toks[alive + i] == d]\n'
     '        conf.append((len(agree) + 1) / (len(alive) + 2))\n'
     '        alive = agree\n'
     '    return conf\n'),
    ("parse_host_port", "split_address",
     'def parse_host_port(address: str, name: str) -> tuple[str, int]:\n'
     '    host, sep, port = str(address).rpartition(":")\n'
     '    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host\n'
     '    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:\n'
     '        raise ValueError(f"{name} must be \'host:port\' with a port in 1..65535, got {address!r}")\n'
     '    return host, int(port)\n'),
    ("drafts_allowed", "may_draft",
     'def drafts_allowed(req: Request) -> bool:\n'
     '    p = req.sampling_params\n'
     '    return not (req.spec_disabled or req.grammar is not None or p.presence_penalty or p.frequency_penalty\n'
     '                or p.repetition_penalty != 1.0)\n'),
    ("fixed_lengths", "verify_all",
     'def fixed_lengths(num_drafts: torch.Tensor) -> torch.Tensor:\n'
     '    """[B] long: verify every proposed draft; negative counts read as 0."""\n'
     '    if num_drafts.dim() != 1:\n'
     '        raise ValueError(f"num_drafts must be 1-D [B], got shape {tuple(num_drafts.shape)}")\n'
     '    return num_drafts.to(torch.long).clamp_min(0)\n'),
    ("build", "make_prompts",
     'def build(self, vocab_size: int) -> tuple[list[list[int]], list[int]]:\n'
     '    rng = np.random.default_rng(self.seed)\n'
     '    in_lens = rng.integers(self.input_len[0], self.input_len[1] + 1, self.num_requests)\n'
     '    out_lens = rng.integers(self.output_len[0], self.output_len[1] + 1, self.num_requests)\n'
     '    prompts = [rng.integers(0, vocab_size, int(n)).tolist() for n in in_lens]\n'
     '    return prompts, [int(n) for n in out_lens]\n'),
    ("time_to_first_token", "ttft",
     'def time_to_first_token(self) -> float | None:\n'
     '    return None if self.first_token_time is None else self.first_token_time - self.arrival_time\n'),
    ("shutdown", "close",
     'def shutdown(self) -> None:\n'
     '    engine, self.engine = getattr(self, "engine", None), None\n'
     '    if engine is None:\n'
     '        return\n'
     '    engine.shutdown()\n'
     '    del engine\n'
     '    gc.collect()\n'
     '    if torch.cuda.is_available():\n'
     '        torch.cuda.empty_cache()\n'),
]

CHAT_QUESTIONS = [
    "What are some good habits for getting better sleep?",
    "Why is the sky blue? Explain it simply.",
    "Give me three ideas for a weekend trip with children.",
    "What is the difference between a virus and a bacterium?",
    "How do I start learning to play the guitar?",
    "Write a short poem about autumn leaves.",
    "What should I consider when adopting a dog?",
    "Explain what inflation is and why it matters.",
    "How can I make my small apartment feel bigger?",
    "What are the benefits of learning a second language?",
    "Suggest a simple vegetarian dinner recipe.",
    "Why do cats purr?",
    "How does a bicycle stay upright when it moves?",
    "What are good ways to prepare for a job interview?",
    "Tell me a fun fact about the ocean and explain it.",
    "How do plants know which way is up?",
]

SUMMARY_INSTRUCTIONS = [
    "Summarize the following text in two sentences.",
    "Write a one-paragraph summary of this text.",
    "Summarize the main points of the following text as a short bulleted list.",
    "In a few sentences, what is this text about?",
]

TASKS = ("edit", "summarize", "chat")
MODES = {
    "none": None,
    "fixed-2": {"method": "ngram", "num_speculative_tokens": 2, "policy": "fixed"},
    "fixed-4": {"method": "ngram", "num_speculative_tokens": 4, "policy": "fixed"},
    "confidence-4": {"method": "ngram", "num_speculative_tokens": 4, "policy": "confidence"},  # + verify_budget
    # model drafters (not in the default set: each needs its model)
    "head-4": {"method": "draft_head", "num_speculative_tokens": 4, "policy": "fixed"},        # + draft_model
    "head-confidence-4": {"method": "draft_head", "num_speculative_tokens": 4, "policy": "confidence"},
    "mtp-2": {"method": "mtp", "num_speculative_tokens": 2, "policy": "fixed"},                # DeepSeek-V4
    "dspark-2": {"method": "dspark", "num_speculative_tokens": 2, "policy": "fixed"},          # DeepSeek-V4.1
}
DEFAULT_MODES = ("none", "fixed-2", "fixed-4", "confidence-4")
# e.g. "fixed-4+async": the mode with async scheduling asked for (speculation's default is synchronous; the async
# peer in the same run). Results at 076d111 used "+sync" the other way round (async was then the CUDA default);
# each row's `async_scheduling` says which ran.
ASYNC_SUFFIX = "+async"


def mode_parts(mode: str) -> tuple[str, bool]:
    """(the MODES entry, whether async scheduling is asked for) of a mode name."""
    if mode.endswith(ASYNC_SUFFIX):
        return mode[:-len(ASYNC_SUFFIX)], True
    return mode, False


def add_typos(text: str, seed: int, every: int = 7) -> str:
    """Swap two adjacent inner letters in about one word of `every` of four letters or more (deterministic)."""
    rng = random.Random(seed)
    words = text.split(" ")
    for i, w in enumerate(words):
        # adjacent inner letters (not the first or last letter of the word)
        pairs = [a for a in range(1, len(w) - 2) if w[a].isalpha() and w[a + 1].isalpha() and w[a] != w[a + 1]]
        if len(w) >= 4 and pairs and rng.random() < 1.0 / every:
            a = rng.choice(pairs)
            words[i] = w[:a] + w[a + 1] + w[a] + w[a + 2:]
    return " ".join(words)


def task_prompts(task: str, n: int) -> list[str]:
    """The first n user messages of a task (cycling its texts with different variants: distinct prompts)."""
    out = []
    i = 0
    while len(out) < n:
        if task == "edit":
            if i % 2 == 0:     # typo fixing over the paragraphs, a new typo seed each round
                para = PARAGRAPHS[(i // 2) % len(PARAGRAPHS)]
                out.append("Rewrite the following paragraph, fixing the typos. Keep everything else the same.\n\n"
                           + add_typos(para, seed=i))
            else:              # rename a function of openinfer's own source
                old, new, code = CODE[(i // 2) % len(CODE)]
                suffix = "" if i // (2 * len(CODE)) == 0 else f"_v{i // (2 * len(CODE)) + 1}"
                out.append(f"Repeat the following Python code with the function `{old}` renamed to `{new}{suffix}`. "
                           f"Change nothing else.\n\n```python\n{code}```")
        elif task == "summarize":
            para = PARAGRAPHS[i % len(PARAGRAPHS)]
            instr = SUMMARY_INSTRUCTIONS[(i // len(PARAGRAPHS) + i) % len(SUMMARY_INSTRUCTIONS)]
            out.append(f"{instr}\n\n{para}")
        elif task == "chat":
            q = CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]
            out.append(q if i < len(CHAT_QUESTIONS) else f"{q} Please answer briefly.")
        else:
            raise ValueError(f"unknown task {task!r}; known: {list(TASKS)}")
        i += 1
    return out


# ---------------------------------------------------------------------------------------------------------------

@dataclass
class SpecBenchConfig:
    model: str
    device: str | None = "cpu"
    dtype: str = "auto"
    concurrency: tuple[int, ...] = (1, 4, 16)
    sampled_concurrency: tuple[int, ...] | None = None   # None: all of `concurrency`
    tasks: tuple[str, ...] = TASKS
    modes: tuple[str, ...] = DEFAULT_MODES
    draft_model: str | None = None                       # the `head-*` modes' trained head (tools/train_draft_head.py)
    temperatures: tuple[float, ...] = (0.0, 0.7)
    max_tokens: int = 128
    min_requests: int = 4
    budget_per_seq: int = 2
    max_num_batched_tokens: int = 2048
    block_size: int = 128
    kv_cache_memory_bytes: int | None = None
    seed: int = 0
    threads: int | None = None                            # torch threads (None: torch's default)


class _StepCounter:
    """Wraps an engine's output processor: per request, steps that verified drafts and steps that sampled."""

    def __init__(self, engine):
        self.draft_steps = 0       # (request, step) pairs with >= 1 draft verified
        self.sample_steps = 0      # (request, step) pairs that sampled (decode or last prefill chunk)
        self.engine_steps = 0      # forwards with at least one sampled row
        self.drafts = 0
        inner = engine.output_processor.process

        def process(runner_out, requests, following=None):
            if runner_out.sampled is not None:
                self.engine_steps += 1
                # (under async scheduling a request's stop is found one step late: rows of the step after it,
                # which its metrics never count, are left out here too)
                live = [rid for rid in runner_out.sample_index if rid in requests and not requests[rid].is_finished]
                self.sample_steps += len(live)
                for rid in live:
                    d = runner_out.drafts.get(rid)
                    if d:
                        self.draft_steps += 1
                        self.drafts += len(d)
            return inner(runner_out, requests, following)

        engine.output_processor.process = process

    def snapshot(self) -> tuple[int, int, int, int]:
        return self.draft_steps, self.sample_steps, self.engine_steps, self.drafts


def _env_info(device: str) -> dict:
    import torch

    info = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
            "python": platform.python_version(), "torch_threads": torch.get_num_threads()}
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
        # files changed against that commit (tracked only): the code measured is the commit plus these
        info["modified_files"] = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
            cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.split("\n")[:-1]
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = None
    if os.environ.get("OPENINFER_COMMIT"):
        # a copy of the tree whose .git is stale (a remote device): the caller names the commit measured
        info["commit"], info["modified_files"] = os.environ["OPENINFER_COMMIT"], []
    if device.startswith("cuda"):
        info["device"] = f"cuda ({torch.cuda.get_device_name()})"
    else:
        name = platform.processor() or "unknown"
        try:
            for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
                if line.startswith("Model name:"):
                    name = line.split(":", 1)[1].strip()
        except OSError:
            pass
        info["device"] = f"cpu ({name}, {os.cpu_count()} logical cores)"
    return info


def _run_cell(llm, counter: _StepCounter, prompts: list[str], temperature: float, max_tokens: int, seed: int):
    from openinfer.sampling_params import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens,
                             seed=None if temperature == 0 else seed + i) for i in range(len(prompts))]
    before = counter.snapshot()
    load0 = os.getloadavg()[0]
    cpu0 = time.process_time()
    start = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu0
    after = counter.snapshot()
    draft_steps, sample_steps, engine_steps, drafts_seen = (a - b for a, b in zip(after, before))
    comp = [o.outputs[0] for o in outs]
    n_out = sum(len(c.token_ids) for c in comp)
    drafted = sum(c.num_draft_tokens for c in comp)
    accepted = sum(c.num_accepted_tokens for c in comp)
    tpots = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(c.token_ids) - 1)
             for o, c in zip(outs, comp) if len(c.token_ids) > 1 and o.metrics.finished_time is not None]
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs if o.metrics.first_token_time]
    row = {
        "num_requests": len(prompts), "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
        "output_tokens": n_out, "elapsed_s": elapsed, "output_tok_per_s": n_out / elapsed,
        # this process's CPU seconds (all its threads): less sensitive than wall time to other jobs on the host
        "cpu_s": cpu, "output_tok_per_cpu_s": n_out / cpu,
        "tpot_ms": 1000 * sum(tpots) / len(tpots) if tpots else None,
        "ttft_ms": 1000 * sum(ttfts) / len(ttfts) if ttfts else None,
        "finish_reasons": {r: sum(c.finish_reason == r for c in comp) for r in {c.finish_reason for c in comp}},
        "drafted_tokens": drafted, "accepted_tokens": accepted,
        # async scheduling: steps queued before the request's verify step was read back, and those dropped
        "guessed_steps": sum(o.metrics.num_guessed_steps for o in outs),
        "guessed_steps_dropped": sum(o.metrics.num_guessed_steps_dropped for o in outs),
        "accept_rate": accepted / drafted if drafted else None,
        "drafting_request_steps": draft_steps,
        # the spec's "mean accepted length": tokens a verify step yields (accepted drafts + the target's own)
        "mean_accepted_length": accepted / draft_steps + 1 if draft_steps else None,
        "verified_drafts_per_step": drafted / draft_steps if draft_steps else None,
        # over every sampling request-step, drafting or not (the first token from prefill included)
        "tokens_per_request_step": n_out / sample_steps if sample_steps else None,
        "engine_steps": engine_steps, "loadavg_1m": [load0, os.getloadavg()[0]],
    }
    assert drafts_seen == drafted, (drafts_seen, drafted)   # the wrapper saw exactly the drafts the metrics count
    return row, [c.token_ids for c in comp], [c.text for c in comp]


def run_spec_bench(cfg: SpecBenchConfig, log=print) -> dict:
    import torch

    from openinfer.entrypoints.llm import LLM
    from openinfer.sampling_params import SamplingParams

    sampled_c = set(cfg.concurrency if cfg.sampled_concurrency is None else cfg.sampled_concurrency)
    for m in cfg.modes:
        if mode_parts(m)[0] not in MODES:
            raise ValueError(f"unknown mode {m!r}; known: {list(MODES)}, each optionally with {ASYNC_SUFFIX!r}")
    if "none" not in cfg.modes:
        raise ValueError("modes must include 'none' (the baseline)")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    result = {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(cfg).items()},
              "concurrency_semantics": "engine max_num_seqs = c, all of a cell's max(c, min_requests) requests "
                                       "submitted at once (continuous batching); one engine per (mode, c), the "
                                       "engines of one c alive together and their cells interleaved (mode order "
                                       "reversed every other cell) so load drift hits every mode alike; prefix "
                                       "caching off",
              "rows": []}
    tokens: dict[tuple, list] = {}
    texts: dict[tuple, list] = {}
    t_start = time.perf_counter()
    cell = 0
    for c in cfg.concurrency:
        n = max(c, cfg.min_requests)
        prompts = {t: task_prompts(t, n) for t in cfg.tasks}
        engines = {}
        for mode in cfg.modes:
            spec, want_async = MODES[mode_parts(mode)[0]], mode_parts(mode)[1]
            if spec is not None and spec["policy"] == "confidence":
                spec = dict(spec, verify_budget=cfg.budget_per_seq * c)
            if spec is not None and spec["method"] == "draft_head":
                if cfg.draft_model is None:
                    raise ValueError(f"mode {mode!r} needs --draft-model (a head trained by "
                                     f"python -m openinfer.tools.train_draft_head)")
                spec = dict(spec, draft_model=cfg.draft_model)
            t0 = time.perf_counter()
            llm = LLM(cfg.model, device=cfg.device, dtype=cfg.dtype, max_num_seqs=c,
                      max_num_batched_tokens=cfg.max_num_batched_tokens, block_size=cfg.block_size,
                      enable_prefix_caching=False, kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
                      speculative_config=spec, async_scheduling=True if want_async else None)
            if "env" not in result:
                result["env"] = _env_info(str(llm.config.device))
                result["env"]["torch_threads"] = torch.get_num_threads()
                result["model"] = cfg.model
                result["dtype"] = str(llm.config.torch_dtype)
            counter = _StepCounter(llm.engine)
            # warm-up, on prompts not in the workload: every batch size up to c once, and each task's prompt
            # lengths at batch c (on the GPU the first long prefills compile kernels: seconds in a timed cell)
            llm.chat([[{"role": "user", "content": f"Say hello number {i}."}] for i in range(c)],
                     SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
            for task in cfg.tasks:
                llm.chat([[{"role": "user", "content": q}] for q in task_prompts(task, n + c)[n:]],
                         SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
            engines[mode] = (llm, counter, spec, time.perf_counter() - t0)
        for temp in cfg.temperatures:
            if temp != 0 and c not in sampled_c:
                continue
            for task in cfg.tasks:
                order = list(cfg.modes) if cell % 2 == 0 else list(reversed(cfg.modes))
                cell += 1
                for mode in order:
                    llm, counter, spec, setup_s = engines[mode]
                    row, toks, txt = _run_cell(llm, counter, prompts[task], temp, cfg.max_tokens, cfg.seed)
                    row.update(task=task, temperature=temp, mode=mode, concurrency=c, speculative_config=spec,
                               engine_setup_s=setup_s, async_scheduling=llm.engine.async_scheduling)
                    tokens[(task, temp, c, mode)], texts[(task, temp, c, mode)] = toks, txt
                    result["rows"].append(row)
                    log(_fmt_row(row))
        for llm, *_ in engines.values():
            llm.shutdown()
        del engines, llm
    # ratios to none and greedy identity, per (task, temperature, concurrency)
    order = {m: i for i, m in enumerate(MODES)}
    result["rows"].sort(key=lambda r: (cfg.concurrency.index(r["concurrency"]), r["temperature"],
                                       cfg.tasks.index(r["task"]), order[mode_parts(r["mode"])[0]],
                                       mode_parts(r["mode"])[1]))
    for row in result["rows"]:
        key = (row["task"], row["temperature"], row["concurrency"])
        base = next(r for r in result["rows"] if r["mode"] == "none" and
                    (r["task"], r["temperature"], r["concurrency"]) == key)
        if row["mode"] == "none":
            continue
        row["tok_per_s_vs_none"] = row["output_tok_per_s"] / base["output_tok_per_s"]
        row["tok_per_cpu_s_vs_none"] = row["output_tok_per_cpu_s"] / base["output_tok_per_cpu_s"]
        row["tpot_vs_none"] = row["tpot_ms"] / base["tpot_ms"] if row["tpot_ms"] and base["tpot_ms"] else None
        if row["temperature"] == 0:
            mine, ref = tokens[key + (row["mode"],)], tokens[key + ("none",)]
            same = [a == b for a, b in zip(mine, ref)]
            row["greedy_identical_fraction"] = sum(same) / len(same)
            row["greedy_mismatches"] = [
                {"request": i, "first_diff": next((j for j, (x, y) in enumerate(zip(a, b)) if x != y),
                                                  min(len(a), len(b))), "len": len(a), "len_none": len(b)}
                for i, (a, b) in enumerate(zip(mine, ref)) if a != b]
    # batch-shape noise floor: plain greedy at different concurrencies (same prompts where they overlap)
    floor = []
    cs = list(cfg.concurrency)
    for task in cfg.tasks:
        for c in cs[1:]:
            a, b = tokens.get((task, 0.0, cs[0], "none")), tokens.get((task, 0.0, c, "none"))
            if a and b:
                m = min(len(a), len(b))
                floor.append({"task": task, "c_a": cs[0], "c_b": c, "compared": m,
                              "identical": sum(x == y for x, y in zip(a[:m], b[:m]))})
    result["none_greedy_across_concurrency"] = floor
    result["sample_outputs"] = {f"{t}/T{temp:g}/c{c}/{m}": v[:1] for (t, temp, c, m), v in texts.items()
                                if m in ("none", "fixed-4")}
    greedy = [r for r in result["rows"] if r["mode"] != "none" and r["temperature"] == 0]
    result["greedy_identical_fraction"] = (
        sum(r["greedy_identical_fraction"] * r["num_requests"] for r in greedy) / sum(r["num_requests"] for r in greedy)
        if greedy else None)
    result["total_s"] = time.perf_counter() - t_start
    return result


def _f(x, spec=".2f"):
    return "-" if x is None else format(x, spec)


def _fmt_row(r: dict) -> str:
    return (f"{r['task']:9s} T={r['temperature']:<3} c={r['concurrency']:<3d} {r['mode']:13s} "
            f"n={r['num_requests']:<3d} out={r['output_tokens']:<5d} {r['output_tok_per_s']:7.1f} tok/s "
            f"{r['output_tok_per_cpu_s']:6.1f} tok/cpu-s TPOT {_f(r['tpot_ms'], '.1f')} ms "
            f"acc {_f(r['accept_rate'])} len {_f(r['mean_accepted_length'])} ver/step "
            f"{_f(r['verified_drafts_per_step'])} same {_f(r.get('greedy_identical_fraction'))}")


def markdown_table(result: dict) -> str:
    lines = ["| task | T | c | mode | accept rate | mean acc. len | verified/step | out tok/s | vs none | "
             "tok/CPU-s vs none | TPOT ms | vs none | greedy = none |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['task']} | {r['temperature']:g} | {r['concurrency']} | {r['mode']} | {_f(r['accept_rate'])} | "
            f"{_f(r['mean_accepted_length'])} | {_f(r['verified_drafts_per_step'])} | "
            f"{r['output_tok_per_s']:.1f} | {_f(r.get('tok_per_s_vs_none'))} | "
            f"{_f(r.get('tok_per_cpu_s_vs_none'))} | {_f(r['tpot_ms'], '.1f')} | "
            f"{_f(r.get('tpot_vs_none'))} | {_f(r.get('greedy_identical_fraction'), '.0%')} |")
    return "\n".join(lines)


def _ints(text: str) -> tuple[int, ...]:
    vals = tuple(int(v) for v in text.split(",") if v.strip())
    if not vals or min(vals) < 1:
        raise ValueError(f"want a comma-separated list of positive integers, got {text!r}")
    return vals


def add_cli_args(p) -> None:
    p.add_argument("--model", default=None, help="default: the engine's default model")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated requests in flight (max_num_seqs)")
    p.add_argument("--sampled-concurrency", default=None,
                   help="concurrencies that also run the sampled temperature (default: all)")
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, of {list(TASKS)}")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated, of {list(MODES)}; "
                   f"a mode + {ASYNC_SUFFIX!r} runs it with async scheduling")
    p.add_argument("--draft-model", default=None, help="the head-* modes' draft head directory (tools/train_draft_head.py)")
    p.add_argument("--temperatures", default="0,0.7", help="comma-separated; 0 = greedy (checked against none)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-requests", type=int, default=4, help="requests per cell: max(concurrency, this)")
    p.add_argument("--budget-per-seq", type=int, default=2,
                   help="confidence-4: verify_budget = this x concurrency draft tokens per step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--quick", action="store_true",
                   help="check the plumbing: concurrency 1,2, one request each, 16 tokens, all modes and tasks")
    p.add_argument("--result-json", default=None)
    p.add_argument("--markdown", action="store_true", help="also print the results as a Markdown table")


def cli_main(args) -> int:
    from openinfer.config import DEFAULT_MODEL

    cfg = SpecBenchConfig(
        model=args.model or DEFAULT_MODEL, device=args.device, dtype=args.dtype,
        concurrency=_ints(args.concurrency),
        sampled_concurrency=None if args.sampled_concurrency is None else _ints(args.sampled_concurrency),
        tasks=tuple(t for t in args.tasks.split(",") if t), modes=tuple(m for m in args.modes.split(",") if m),
        draft_model=args.draft_model,
        temperatures=tuple(float(t) for t in args.temperatures.split(",") if t), max_tokens=args.max_tokens,
        min_requests=args.min_requests, budget_per_seq=args.budget_per_seq,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, seed=args.seed, threads=args.threads)
    for t in cfg.tasks:
        if t not in TASKS:
            raise ValueError(f"unknown task {t!r}; known: {list(TASKS)}")
    if args.quick:
        cfg.concurrency, cfg.sampled_concurrency, cfg.min_requests, cfg.max_tokens = (1, 2), None, 1, 16
    result = run_spec_bench(cfg, log=lambda s: print(s, flush=True))
    result["command"] = " ".join(["openinfer"] + sys.argv[1:]) if sys.argv else None
    frac = result["greedy_identical_fraction"]
    print(f"greedy outputs identical to none: {_f(frac, '.1%')}; total {result['total_s']:.0f}s")
    if args.markdown:
        print(markdown_table(result))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    if frac is not None and frac < 1.0:
        print("openinfer bench spec: greedy outputs with speculation differ from plain decoding (see "
              "greedy_mismatches and none_greedy_across_concurrency in the results)", file=sys.stderr)
        return 1
    return 0
