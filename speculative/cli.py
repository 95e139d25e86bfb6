"""`python -m speculative`: generate from a prompt in one process and print statistics.

python -m speculative "Write a haiku about the sea." --drafter ngram --k 4
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time

from foundation.errors import SpeculativeError
from foundation.limits import MAX_TREE_WIDTH
from model_runtime.loading import DEFAULT_MODEL, DTYPES, configure_threads, load_model
from model_runtime.quantization import SCHEMES, SELF_QUANTIZATION, resolve_draft
from speculative.drafters import ModelDrafter
from speculative.generator import SpeculativeGenerator
from speculative.policy import AdaptiveK, FixedK, SpeculationPolicy
from speculative.prompt_lookup import LookupThenModelDrafter, NgramDrafter
from speculative.sampling import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m speculative", description=__doc__.splitlines()[0]
    )
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="target model: packaged name, .gguf path, HF id or tiny-random[:SEED]",
    )
    parser.add_argument(
        "--drafter",
        default="ngram",
        help="'ngram', 'none', 'model:NAME' (a small model with the target's tokenizer; "
        "'model:self' = the target's own weights, quantized) or 'ngram+model:NAME' (prompt lookup, the model "
        "where it finds nothing)",
    )
    parser.add_argument(
        "--draft-quantization",
        default="",
        choices=["", *SCHEMES],
        help=f"the draft model's linears; empty = {SELF_QUANTIZATION} for 'self', none otherwise",
    )
    parser.add_argument(
        "--draft-keep-output-layer",
        action="store_true",
        help="leave the draft's output layer unquantized",
    )
    parser.add_argument("--k", type=int, default=4, help="draft tokens per round (0 = target-only)")
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="choose k per round (up to --k) from measured acceptance and costs",
    )
    parser.add_argument(
        "--tree-width",
        type=int,
        default=1,
        help="continuations a round may propose as a token tree "
        "(1: chains; adaptive: where the policy finds their nodes pay)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--raw", action="store_true", help="do not wrap the prompt in the model's chat template"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument(
        "--device-map", default=None, help="e.g. 'auto' to shard the target across GPUs"
    )
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    configure_threads(args.threads)
    try:
        return _run(args)
    except SpeculativeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _policy(args, drafts: bool) -> int | SpeculationPolicy:
    if not 1 <= args.tree_width <= MAX_TREE_WIDTH:
        raise SystemExit(f"--tree-width must be in [1, {MAX_TREE_WIDTH}], got {args.tree_width}")
    if not drafts or args.k == 0:
        return 0
    return (
        AdaptiveK(args.k, max_width=args.tree_width)
        if args.adaptive
        else FixedK(args.k, args.tree_width)
    )


def _run(args) -> int:
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
    ).validate()
    with _progress(f"loading {args.model}"):
        target = load_model(
            args.model, device=args.device, dtype=args.dtype, device_map=args.device_map
        )
        drafter = _make_drafter(args)
    generator = SpeculativeGenerator(target, drafter)
    prompt_ids = _encode(target.tokenizer, args.prompt, chat=not args.raw)
    if target.eos_token_id is not None:
        params = params.replace(stop_token_ids=(target.eos_token_id,))
    result = generator.generate(prompt_ids, params, k=_policy(args, drafter is not None))
    print(target.tokenizer.decode(result.token_ids, skip_special_tokens=True))
    print(
        f"\n--- {drafter.name if drafter else 'target only'}, k={args.k}, "
        f"finish: {result.finish_reason.value}",
        file=sys.stderr,
    )
    print(result.stats.summary(), file=sys.stderr)
    return 0


def _make_drafter(args):
    if args.drafter == "none" or args.k == 0:
        return None
    if args.drafter == "ngram":
        return NgramDrafter()
    kind, _, name = args.drafter.partition(":")
    if kind not in ("model", "ngram+model") or not name:
        raise SystemExit(
            f"error: --drafter must be 'ngram', 'none', 'model:NAME' or 'ngram+model:NAME', got {args.drafter!r}"
        )
    name, quantization = resolve_draft(name, args.draft_quantization, args.model)
    model = ModelDrafter(
        load_model(
            name,
            device=args.device,
            dtype=args.dtype,
            quantize=quantization,
            keep_output_layer=args.draft_keep_output_layer,
        )
    )
    return model if kind == "model" else LookupThenModelDrafter(model, NgramDrafter())


def _encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    return tokenizer(prompt).input_ids


class _progress:
    """A spinner with elapsed seconds on stderr while something slow runs."""

    def __init__(self, label: str):
        self.label = label
        self.done = threading.Event()

    def __enter__(self):
        self.start = time.monotonic()
        print(f"{self.label} ...", file=sys.stderr, flush=True)
        self.thread = threading.Thread(target=self._spin, daemon=True)
        if sys.stderr.isatty():  # a spinner in a log file is noise
            self.thread.start()

    def __exit__(self, *exc):
        self.done.set()
        if self.thread.is_alive():
            self.thread.join()
        print(f"\r{self.label}: done in {time.monotonic() - self.start:.1f} s", file=sys.stderr)

    def _spin(self):
        frames = "|/-\\"
        index = 0
        while not self.done.wait(0.25):
            elapsed = time.monotonic() - self.start
            print(
                f"\r{self.label} {frames[index % 4]} {elapsed:.0f} s",
                end="",
                file=sys.stderr,
                flush=True,
            )
            index += 1
