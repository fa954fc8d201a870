"""Engine flags, their defaults and the engine configuration, declared once.

Torch-free on purpose: the GUI imports this module to build its settings form, and the CLI builds
its argument parser from the same `FLAGS`. Each flag uses vLLM's name, so commands written for vLLM
carry over. A flag for a feature that is not built gets a clear "not supported yet" error from
`EngineConfig.validate`, never silent acceptance.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from engine.config.mm_processor import parse_mm_processor_kwargs

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
KV_OFFLOADING_BACKENDS = ("native",)  # vLLM's names; "lmcache" is not built
MODEL_TTL_ACTIONS = ("unload", "sleep")
SLEEP_LEVELS = (1, 2)
DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")
DEVICES = ("auto", "cuda", "cpu")
ATTENTION_BACKENDS = ("auto", "triton", "torch")
CPU_LINEARS = ("rows", "numba", "torch")  # kernels/cpu_linear.py's backends (this module stays torch-free)
CUDA_GRAPH_MODES = ("full_and_piecewise", "full_decode_only")  # vLLM's cudagraph_mode names; --enforce-eager: none
SCHEDULING_POLICIES = ("fcfs", "priority")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "qwen3_coder", "openai", "harmony")  # engine/tool_parsers
REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss", "harmony")  # engine/reasoning
SUPPORTED_QUANTIZATION = ("awq", "gptq", "compressed-tensors", "fp8", "mxfp4", "auto-round", "gguf")  # engine/quantization/config.py reads them
DEFAULT_CPU_KV_CACHE_GIB = 1.0
OFFLINE_MAX_NUM_BATCHED_TOKENS = 8192
# Online serving's step budget and prompt-token cap, per device: a step's cost grows with its tokens and
# every running stream waits for the whole step, so the prompt tokens a decoding step may take bound how
# long an arriving prompt stalls the streams' next token. On CUDA a 2048-token step costs about a decode
# step (vLLM's serving default), so the budget alone does it. On CPU a prompt token costs about as much as
# a decode row, so only small chunks keep ITL p99 within 3x the median (BENCHMARKS.md, "pagedesk-bench
# itl"): the budget stays large so decodes are never cut, and prompt tokens are capped while anything
# decodes. Offline `LLM` keeps 8192 and no cap (throughput, no streams to stall).
SERVING_MAX_NUM_BATCHED_TOKENS = 2048
SERVING_MAX_BATCH_PREFILL_TOKENS = {"cuda": None, "cpu": 32}
# The decompression-bomb guard: an 8K frame (7680 x 4320, 33 MP), above any screenshot or camera photo people send,
# refused before it is decoded (PIL's own limit is ~5x that). It only sizes the encoder where it is below the
# processor's largest image; --mm-processor-kwargs is how images are made smaller (resized, not refused).
DEFAULT_MAX_IMAGE_PIXELS = 7680 * 4320
MM_MODALITIES = ("image",)  # what --limit-mm-per-prompt may name


@dataclass(frozen=True, slots=True)
class Flag:
    """One engine or server setting: its CLI spelling, type, default and help, used by CLI and GUI."""

    name: str  # attribute name, e.g. "max_model_len"; CLI spelling is --max-model-len
    type: type
    default: Any
    help: str
    group: str = "engine"  # engine | scheduler | cache | parallel | server
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    negatable: bool = False  # booleans that default on get --no-<name>
    gui: bool = True  # shown in the GUI's settings form

    @property
    def cli(self) -> str:
        return "--" + self.name.replace("_", "-")


FLAGS: tuple[Flag, ...] = (
    Flag("model", str, None, "Hugging Face model folder or hub repo id", "model", gui=False),
    Flag("served_model_name", str, None, "Model name reported by the API (default: --model)", "server"),
    Flag("tokenizer", str, None, "Tokenizer folder or repo id (default: --model)", "model", gui=False),
    Flag("revision", str, None, "Hub revision of the model", "model", gui=False),
    Flag("task", str, "auto", "generate: completions and chat; embed: /v1/embeddings (pooled hidden states, no "
         "LM head); auto: embed for an embedding checkpoint (sentence-transformers Pooling module or a bare "
         "...Model architecture), else generate", "model", ("auto", "generate", "embed"), gui=False),
    Flag("trust_remote_code", bool, False, "Allow custom code from the model repo (tokenizer only)", "model", gui=False),
    Flag("dtype", str, "auto", "Weight/activation dtype; auto: float32 on CPU, bf16/fp16 on CUDA", "engine", DTYPES),
    Flag("device", str, "auto", "Where the engine runs", "engine", DEVICES, gui=False),
    Flag("seed", int, 0, "Seed for requests that do not set their own", "engine", minimum=0),
    Flag("max_model_len", int, None, "Longest prompt + output, in tokens (default: model's context)", "engine",
         minimum=1),
    Flag("quantization", str, None, "Weight quantization method; the model folder's quantization_config decides, "
         "this only confirms it", "engine", SUPPORTED_QUANTIZATION, gui=False),
    Flag("enforce_eager", bool, False, "Never capture CUDA graphs", "engine"),
    Flag("cuda_graph_mode", str, "full_and_piecewise", "full_and_piecewise: whole-forward graphs for decode steps "
         "and piecewise graphs (attention eager) for prompt and mixed steps; full_decode_only: decode graphs only",
         "engine", CUDA_GRAPH_MODES, gui=False),
    Flag("attention_backend", str, "auto", "auto: Triton on CUDA, torch on CPU", "engine", ATTENTION_BACKENDS,
         gui=False),
    Flag("speculative_config", str, None, "Speculative decoding as JSON, vLLM's names: {\"method\": \"ngram\", "
         "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 3}, {\"model\": DRAFT_FOLDER, "
         "\"num_speculative_tokens\": 3} or, for a checkpoint with an MTP head (Qwen3.5/3.6, Qwen3-Next), "
         "{\"method\": \"mtp\", \"num_speculative_tokens\": 2} (default: off)", "engine", gui=False),
    Flag("async_scheduling", bool, False, "Schedule and prepare step N+1 while step N runs on the device (vLLM's "
         "async scheduling): the next input tokens are fed on the device and stop conditions are checked one step "
         "late, with identical output; steps that need their tokens on the host first (structured output, "
         "penalties, bad words, min_tokens, beams, n>1 forks, speculative decoding) run one at a time",
         "engine", negatable=True, gui=False),
    Flag("compile_cpu_forward", bool, False, "On the CPU: run the model's forward through torch.compile, attention "
         "eager between the compiled pieces (fewer, fused ops per step for small models); the first steps wait for "
         "the compile, about a minute on two cores", "engine", gui=False),
    Flag("cpu_linear", str, "rows", "On the CPU: float32 linears of decode steps through a kernel that reads each "
         "weight once: built for this CPU by the system C compiler where there is one (up to 32 rows; the float32 "
         "decode attention natively too), else numba's (up to 16 rows) (rows); numba's always, attention too "
         "(numba); or always torch's F.linear, and torch's ops for the norms and activations that a decode batch "
         "otherwise runs as one native call each (torch)", "engine",
         CPU_LINEARS, gui=False),
    Flag("cpu_dequant_cache", float, 0.0, "On the CPU: GiB of float copies of quantized (GGUF, GPTQ, ...) linear "
         "weights, dequantized once at start, layer by layer while the budget lasts, so those layers multiply as "
         "fast as float ones; 0 (default) keeps every weight only in its blocks, dequantized on each call",
         "engine", gui=False, minimum=0.0),
    Flag("block_size", int, 16, "Tokens per KV-cache block", "cache", (8, 16, 32, 64)),
    Flag("gpu_memory_utilization", float, 0.9, "Fraction of each card's memory the engine may use", "cache",
         minimum=0.05, maximum=1.0),
    Flag("kv_cache_memory", float, None, f"KV cache size in GiB (CPU default {DEFAULT_CPU_KV_CACHE_GIB}); on CUDA an "
         "absolute budget instead of --gpu-memory-utilization's share, so engines can share a card",
         "cache", minimum=0.0, gui=False),
    Flag("num_gpu_blocks_override", int, None, "Exact number of KV blocks (overrides memory sizing)", "cache",
         minimum=1, gui=False),
    Flag("kv_cache_dtype", str, "auto", "KV cache storage; fp8 and int8 halve its memory, int4 takes about a third "
         "(integer formats keep a scale per token and head: int8 one per head, int4 one per 32 values)", "cache",
         KV_CACHE_DTYPES),
    Flag("kv_offloading_size", float, None, "GiB of CPU RAM (over all tensor-parallel ranks) for the prefix cache's "
         "second tier: blocks evicted from the GPU's prefix cache are kept there and copied back on a hit instead "
         "of recomputed (default: off)", "cache", minimum=0.0),
    Flag("kv_offloading_backend", str, "native", "Where --kv-offloading-size keeps blocks: native (this engine's "
         "pinned host memory)", "cache", KV_OFFLOADING_BACKENDS, gui=False),
    Flag("enable_prefix_caching", bool, True, "Reuse KV blocks of shared prompt prefixes", "cache",
         negatable=True),
    Flag("max_num_seqs", int, 256, "Most sequences in one step", "scheduler", minimum=1),
    Flag("max_num_batched_tokens", int, None, "Token budget of one step (default: serving 2048, offline "
         "8192; at least max_model_len without chunked prefill)", "scheduler", minimum=1),
    Flag("max_batch_prefill_tokens", int, None, "Most prompt tokens a step computes while streams are decoding, "
         "bounding the stall an arriving prompt causes (default: serving 32 on CPU, none on CUDA or offline; 0: "
         "none; needs chunked prefill)", "scheduler", minimum=0),
    Flag("enable_chunked_prefill", bool, True, "Split long prompts over steps while decodes continue",
         "scheduler", negatable=True),
    Flag("scheduling_policy", str, "fcfs", "fcfs: first come, first served; priority: requests with a lower "
         "`priority` value are admitted first (ties by arrival) and the lowest-priority running one is preempted "
         "first", "scheduler", SCHEDULING_POLICIES),
    Flag("tensor_parallel_size", int, 1, "Split the model over this many GPUs", "parallel", minimum=1),
    Flag("data_parallel_size", int, 1, "Full model replicas", "parallel", minimum=1, gui=False),
    Flag("host", str, "127.0.0.1", "Address to bind; 0.0.0.0 exposes the server to your network", "server"),
    Flag("port", int, 8000, "Port to serve on", "server", minimum=1, maximum=65535),
    Flag("api_key", str, None, "Require this bearer token on /v1 routes", "server"),
    Flag("allowed_hosts", str, None, "Comma-separated Host names the server answers (default: localhost names "
         "and --host; '*' answers any, e.g. behind a proxy)", "server", gui=False),
    Flag("allowed_origins", str, None, "Browser origins allowed to call the API (CORS), comma-separated or a JSON "
         "list as vLLM takes it, e.g. http://localhost:3000; '*' allows any (default: none)", "server", gui=False),
    Flag("step_timeout", float, None, "Seconds one engine step may take before the engine is declared stuck and "
         "the server exits with code 4 (default 30 on CUDA, 600 on CPU, where long prefills are slow; the first "
         "step gets at least 300); 0 turns the watchdog off", "server", minimum=0.0, gui=False),
    Flag("stream_idle_timeout", float, 60.0, "Seconds a client may leave a request's output unread before the "
         "request is aborted and its KV blocks freed (a request whose output is unread is not scheduled "
         "meanwhile); 0 turns it off", "server", minimum=0.0, gui=False),
    Flag("tool_call_parser", str, None, "Tool-call format of the model (default: detected from its chat template)",
         "server", TOOL_CALL_PARSERS, gui=False),
    Flag("reasoning_parser", str, None, "Split <think> reasoning into reasoning_content", "server",
         REASONING_PARSERS, gui=False),
    Flag("strict_request_fields", bool, False, "Refuse request fields outside the API with a 400 naming them "
         "(default: they are ignored, logged once and named in the x-pagedesk-ignored-fields response header)",
         "server", gui=False),
    # Images (vision-language checkpoints; engine/multimodal): vLLM's names where vLLM has the flag.
    Flag("limit_mm_per_prompt", str, None, "Most images one prompt may carry, as JSON: '{\"image\": 4}' (default: "
         "no count limit; the context and the encoder budget still bound them); '{\"image\": 0}' serves a "
         "vision-language checkpoint as text: its tower is neither loaded nor planned", "engine", gui=False),
    Flag("max_image_pixels", int, DEFAULT_MAX_IMAGE_PIXELS, "Largest image accepted, in pixels (width x height) "
         "(refused above, before decoding: a 400 naming the part). Default: an 8K frame, 7680x4320. To make images "
         "cheaper, resize them with --mm-processor-kwargs instead", "engine", minimum=1, gui=False),
    Flag("mm_processor_kwargs", str, None, "Settings for the checkpoint's image processor, as JSON (vLLM's flag): "
         "Qwen '{\"max_pixels\": 1003520}' resizes larger images down to ~1 MP (and '{\"min_pixels\": N}'), "
         "Mistral3 '{\"longest_edge\": 1024}', Gemma 4 '{\"max_soft_tokens\": 140}'; Gemma 3 takes none. The "
         "encoder budget and cache, the tower's profiled peak and the planner follow the largest image the "
         "processor then makes: a smaller one leaves more context (Qwen3.6-27B AWQ, one 24 GB card, 2,048-token "
         "steps: 25,440 KV tokens at the processor's own 16.7 MP, 39,232 at max_pixels 12.2 MP; pagedesk-bench "
         "images-plan). Default: the processor's own largest image", "engine", gui=False),
    Flag("allowed_local_media_path", str, None, "Folder whose files requests may name as file:// image URLs "
         "(default: none)", "server", gui=False),
    Flag("allowed_media_domains", str, None, "Comma-separated hosts whose http(s) image URLs the server fetches "
         "(default: any host)", "server", gui=False),
)

FLAGS_BY_NAME = {f.name: f for f in FLAGS}
SERVER_FLAGS = tuple(f.name for f in FLAGS if f.group == "server")

# Flags of the router (engine/entrypoints/router), which serves several models or replicas behind one endpoint: not
# fields of EngineConfig, since no single engine reads them. `--model NAME=PATH` may be repeated.
ROUTER_FLAGS: tuple[Flag, ...] = (
    Flag("models_dir", str, None, "Serve every model folder under DIR and in the Hugging Face cache, by name",
         "router", gui=False),
    Flag("models_config", str, None, "TOML file of per-model engine flags ([models.NAME] tables, the command "
         "line's flag names)", "router", gui=False),
    Flag("model_ttl", float, None, "Seconds a model may sit idle before its engine is unloaded (default: never)",
         "router", minimum=0.0, gui=False),
    Flag("model_ttl_action", str, "unload", "What --model-ttl does to an idle model: unload its engine, or sleep it "
         "(weights to CPU RAM, KV cache dropped; woken by the next request, faster than a reload)", "router",
         MODEL_TTL_ACTIONS, gui=False),
    Flag("max_loaded_models", int, None, "Most engines loaded at once; the least recently used idle one makes "
         "room (default: as many as fit)", "router", minimum=1, gui=False),
    Flag("memory_budget", float, None, "GiB the router may place engines in, per card (default: each card's free "
         "memory × --gpu-memory-utilization; on CPU the available RAM)", "router", minimum=0.0, gui=False),
)
ROUTER_FLAGS_BY_NAME = {f.name: f for f in ROUTER_FLAGS}


def add_flags(parser: argparse.ArgumentParser, flags: tuple[Flag, ...] = FLAGS) -> None:
    """Add every flag to an argparse parser, vLLM-style (booleans as --x / --no-x)."""
    for f in flags:
        if f.type is bool:
            parser.add_argument(f.cli, action=argparse.BooleanOptionalAction, default=f.default, help=f.help)
        else:
            parser.add_argument(f.cli, type=f.type, default=f.default, choices=f.choices, help=f.help)


def flags_to_argv(values: dict[str, Any]) -> list[str]:
    """Turn {flag name: value} into CLI arguments, leaving out values equal to the default."""
    argv: list[str] = []
    for name, value in values.items():
        f = FLAGS_BY_NAME[name]
        if value is None or value == f.default:
            continue
        if f.type is bool:
            argv.append(f.cli if value else "--no-" + f.cli[2:])
        else:  # a dict (speculative_config) travels as the JSON the flag takes
            text = json.dumps(value) if isinstance(value, dict) else str(value)
            # argparse reads a separate value starting with '-' (a key, a name) as an option: join those
            argv += [f"{f.cli}={text}"] if text.startswith("-") else [f.cli, text]
    return argv


@dataclass
class EngineConfig:
    """Everything the engine needs to start; field names and defaults come from `FLAGS`."""

    model: str = ""
    served_model_name: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    task: str = "auto"
    trust_remote_code: bool = False
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    quantization: str | None = None
    enforce_eager: bool = False
    cuda_graph_mode: str = "full_and_piecewise"
    attention_backend: str = "auto"
    async_scheduling: bool = False
    compile_cpu_forward: bool = False
    cpu_linear: str = "rows"
    cpu_dequant_cache: float = 0.0
    speculative_config: str | dict | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: float | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_dtype: str = "auto"
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_batch_prefill_tokens: int | None = None
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    allowed_hosts: str | None = None
    allowed_origins: str | None = None
    step_timeout: float | None = None
    stream_idle_timeout: float = 60.0
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    strict_request_fields: bool = False
    limit_mm_per_prompt: str | dict | None = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    mm_processor_kwargs: str | dict | None = None
    allowed_local_media_path: str | None = None
    allowed_media_domains: str | None = None
    serving: bool = False  # set by pagedesk-serve: online defaults (a smaller step budget), not a flag
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(names - {'extra'})}")
        return cls(**kwargs)

    def validate(self) -> None:
        """Raise ValueError for settings that are out of range or name an unbuilt feature."""
        for f in FLAGS:
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.choices is not None and value not in f.choices:
                raise ValueError(f"{f.cli} must be one of {list(f.choices)}, got {value!r}")
            if f.minimum is not None and value < f.minimum:
                raise ValueError(f"{f.cli} must be >= {f.minimum}, got {value}")
            if f.maximum is not None and value > f.maximum:
                raise ValueError(f"{f.cli} must be <= {f.maximum}, got {value}")
        if self.quantization is not None:
            from engine.quantization.config import check_folder_quantization
            check_folder_quantization(self.model, self.quantization)
        if self.speculative_config is not None:
            from engine.config.speculative import parse_speculative_config  # torch-free
            spec = parse_speculative_config(self.speculative_config)
            if spec.method != "ngram" and self.kv_cache_dtype in ("int8", "int4"):
                raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} with a draft model or MTP head is not "
                                 "supported yet (their KV caches have no integer format); use n-gram speculation, "
                                 "or --kv-cache-dtype auto or fp8")
        if self.kv_offloading_size and not self.enable_prefix_caching:
            raise ValueError("--kv-offloading-size keeps prefix-cache blocks in CPU RAM, but prefix caching is off "
                             "(--no-enable-prefix-caching); turn it on or leave --kv-offloading-size out")
        self.image_limit()  # a malformed --limit-mm-per-prompt is refused at start
        self.processor_kwargs()  # and a malformed --mm-processor-kwargs (its keys are the checkpoint's to judge)
        if self.data_parallel_size != 1:
            raise ValueError("--data-parallel-size > 1 runs one engine per replica behind pagedesk-serve's router; "
                             "one engine (or the offline LLM) serves one replica")
        if self.compile_cpu_forward and self.tensor_parallel_size != 1:
            raise ValueError("--compile-cpu-forward is not supported yet with --tensor-parallel-size > 1 (its CPU "
                             "collectives run eager); leave one of them out")
        if self.cpu_dequant_cache and self.tensor_parallel_size != 1:
            raise ValueError("--cpu-dequant-cache is not supported yet with --tensor-parallel-size > 1; leave one of "
                             "them out")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key is empty or blank, which no client could send; give a real key, or leave "
                             "the flag out to serve without one")
        if self.api_key is not None and self.api_key != self.api_key.strip():
            raise ValueError("--api-key has leading or trailing whitespace, which clients cannot send in a "
                             "header; remove it")

    def image_limit(self) -> int | None:
        """The most images per prompt (--limit-mm-per-prompt's "image"), or None for no count limit."""
        value = self.limit_mm_per_prompt
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--limit-mm-per-prompt must be JSON such as '{{\"image\": 4}}': {exc}") from None
        if not isinstance(value, dict) or any(not isinstance(v, int) or isinstance(v, bool) or v < 0
                                              for v in value.values()):
            raise ValueError(f"--limit-mm-per-prompt must map modalities to counts >= 0, got {value!r}")
        unknown = sorted(set(value) - set(MM_MODALITIES))
        if unknown:
            raise ValueError(f"--limit-mm-per-prompt names {unknown}; this engine takes {list(MM_MODALITIES)} only")
        return value.get("image")

    def processor_kwargs(self) -> dict[str, Any]:
        """--mm-processor-kwargs as a dict ({} when not given)."""
        return parse_mm_processor_kwargs(self.mm_processor_kwargs)

    def resolve_max_num_batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
                raise ValueError(
                    f"--max-num-batched-tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                    f"({max_model_len}) with chunked prefill off, so long prompts could never run; raise it, "
                    "lower --max-model-len or turn on --enable-chunked-prefill")
            return self.max_num_batched_tokens
        if not self.enable_chunked_prefill:
            return max(OFFLINE_MAX_NUM_BATCHED_TOKENS, max_model_len)
        if self.serving:
            return SERVING_MAX_NUM_BATCHED_TOKENS
        return OFFLINE_MAX_NUM_BATCHED_TOKENS

    def resolve_max_batch_prefill_tokens(self, device_type: str = "cpu") -> int | None:
        """The prompt-token cap of a decoding step, or None for no cap (0 on the command line)."""
        if not self.enable_chunked_prefill:
            return None  # whole prompts: a cap would keep long ones out for good
        if self.max_batch_prefill_tokens is not None:
            return self.max_batch_prefill_tokens or None
        return SERVING_MAX_BATCH_PREFILL_TOKENS.get(device_type) if self.serving else None
