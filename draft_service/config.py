"""Configuration of the draft worker: flags `--model`, `--default-k`, ... and the
environment variables `DRAFT_MODEL`, `DRAFT_DEFAULT_K`, ... (flags win)."""

from __future__ import annotations

from dataclasses import dataclass

from foundation.errors import InvalidArgument
from foundation.limits import MAX_TREE_WIDTH, validate_num_speculative_tokens
from model_runtime.quantization import NONE as NO_QUANTIZATION
from model_runtime.quantization import check_scheme
from service_common.options import RegistryConfig, ServerConfig, TelemetryConfig
from service_common.server import advertised_address, default_worker_id
from speculative.drafter_base import DEFAULT_DRAFT_TOP_K
from speculative.speculation_loop import Features

ENV_PREFIX = "DRAFT"


@dataclass
class DraftConfig(ServerConfig, RegistryConfig, TelemetryConfig):
    # All interfaces, the port after the target's 50051; ":0" binds a free port (tests).
    address: str = "0.0.0.0:50052"
    # The small model of the "model" and "ngram+model" drafters (packaged name, HF id,
    # directory, .gguf or tiny-random[:SEED]); empty = no model, the worker serves the
    # n-gram drafter only (which needs no weights and suits any target).
    model: str = ""
    # Drafter of sessions that do not name one ("model", "ngram" or "ngram+model"):
    # n-gram lookup works without a model and with every target vocabulary.
    default_drafter: str = "ngram"
    # CPU always exists; "cuda" / "cuda:1" on a GPU host.
    device: str = "cpu"
    # fp32 keeps the draft's greedy proposals deterministic on CPU; "bfloat16" on GPUs
    # halves memory (drafts only change speed, never the output).
    dtype: str = "float32"
    # The draft model's linears (model_runtime/quantization.py): a draft's numerics change
    # acceptance, never the output, and "int8-dynamic" drafts 2.5x faster on x86 CPUs.
    quantization: str = NO_QUANTIZATION
    # Leave the output layer unquantized: it picks the token, so acceptance may be
    # higher at the cost of a vocabulary-sized fp32 matmul per token.
    keep_output_layer: bool = False
    # Empty = f"draft-{hostname}-{pid}": unique per process, stable for its lifetime.
    worker_id: str = ""
    # Address other services use to reach this one (e.g. the pod IP in Kubernetes);
    # empty = derived from `address`, with the hostname for a wildcard host.
    advertise_address: str = ""
    # Sessions held at once; the least recently used idle one is evicted (its owner
    # opens it again) when a new one needs room.
    max_sessions: int = 256
    # Tokens held summed over sessions (the draft model's KV caches, or n-gram
    # histories): 256 sessions of 1 Ki tokens; a draft model is small, so this is cheap.
    max_cached_tokens: int = 262144
    # Draft tokens per round when a request does not say: a good trade on the tiny and
    # small models measured in benchmarks/ (acceptance decays with position).
    default_k: int = 4
    # Support of the draft's sampled distribution, in tokens: small proposals on the
    # wire, and the mass outside a small model's top 32 barely changes acceptance.
    draft_top_k: int = DEFAULT_DRAFT_TOP_K
    # n-gram drafter's suffix lengths to look up (speculative.prompt_lookup.NgramDrafter:
    # single-token matches propose mostly wrong tokens).
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # The longest the draft waits for ONE verdict (or Info answer) from a target, in
    # seconds, before it gives up on it with UNAVAILABLE: a hung target is let go, while
    # a Speculate call as a whole (its Verify stream) lives as long as its caller's
    # deadline. Generous: a target that batches many sessions under load is slow, not hung.
    verdict_stall_timeout_s: float = 120.0
    # The longest a call waits for another call to let go of its session (e.g. a
    # Truncate behind a cancelled Speculate's last round), in seconds, within the
    # caller's deadline; then ABORTED. As long as a verdict may take: that round ends
    # when its verdict comes.
    session_wait_timeout_s: float = 120.0
    # The optimisations around the round loop to switch off, comma-separated (each is
    # exact on or off; speculative.speculation_loop.Features, docs/speculation.md):
    # pipeline (draft the next proposal while the last is verified: off where draft and
    # target share cores, else the draft idles through every verification), stretches
    # (target-only runs where speculation loses), target_lookup (in a stretch the target
    # runs prompt lookup's rounds itself), lookup_gate (a cascade's lookup proposes only
    # where it earns more than the model), draft_stop (a model drafter stops where its
    # next token would not pay). Empty: all on.
    disable: str = ""

    def features(self) -> Features:
        return Features.disabled(self.disable)

    # Continuations a round may propose at once as a token tree, verified in one target
    # pass (prompt lookup's distinct matches, a model's second choices;
    # speculative/token_tree.py): fixed-k rounds always, adaptive ones where the policy
    # finds the tree's nodes pay (speculative.policy.branch_reach). 1: chains.
    tree_width: int = 1
    # Fixed-shape passes over KV memory allocated up front, CUDA graphs on a GPU
    # (model_runtime/static_passes.py): a draft token then costs its weights, not its
    # kernel launches. auto: on with CUDA, off on a CPU.
    static_passes: str = "auto"
    static_slots: int = 64  # sessions the pool holds; more run eager
    static_capacity: int = 4096  # tokens a session holds in the pool; longer runs eager
    # Benchmarks and tests only: MODULE:FUNCTION[:ARGUMENT], drafters a plug-in adds under
    # names starting "x-" (the benchmarks' drafter of known acceptance is one:
    # benchmarks/README.md). Empty: none.
    drafter_plugin: str = ""
    # Used when a request leaves max_new_tokens at 0; the same default as the target's.
    default_max_new_tokens: int = 256
    # torch intra-op threads; 0 = torch's default (all cores), which suits a worker
    # that owns its host.
    threads: int = 0
    # On SIGTERM, seconds in-flight calls get to finish (Kubernetes sends SIGKILL 30 s
    # after SIGTERM by default).
    grace_s: float = 10.0
    # INFO logs start-up, evictions and shutdown; DEBUG adds per-call details.
    log_level: str = "INFO"

    def validate(self) -> DraftConfig:
        """Raises InvalidArgument naming the first bad setting (at start-up, not per call)."""
        validate_num_speculative_tokens(self.default_k)
        check_scheme(self.quantization, self.device)
        self.features()  # an unknown --disable name
        if not 1 <= self.tree_width <= MAX_TREE_WIDTH:
            raise InvalidArgument(
                f"tree_width must be in [1, {MAX_TREE_WIDTH}], got {self.tree_width}"
            )
        for name in ("max_sessions", "max_cached_tokens", "draft_top_k", "default_max_new_tokens"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("verdict_stall_timeout_s", "session_wait_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"{name} must be > 0, got {getattr(self, name)}")
        return self

    def resolved_worker_id(self) -> str:
        return self.worker_id or default_worker_id("draft")

    def resolved_advertise_address(self, port: int) -> str:
        return advertised_address(self.advertise_address, self.address, port)
