"""Pipelined drafting: the next proposal drafted and sent while the last one is verified,
assuming all of it accepted and the target's next token the draft's guess. A proposal
whose assumption fails is discarded by the target and redrafted: greedy output stays
target-only greedy, sampling the target's distribution, in process and over gRPC."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

import grpc
import pytest
from scipy.stats import chisquare

from draft_service.remote_verifier import RemoteVerifier
from service_common.deadlines import Deadline
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc
from speculative import rejection
from speculative.drafter_base import DraftSession, Proposal
from speculative.drafters import ModelDrafter
from speculative.generator import LocalVerifier, SpeculativeGenerator
from speculative.policy import FixedK
from speculative.prompt_lookup import LookupThenModelDrafter, NgramDrafter
from speculative.sampling import SamplingParams
from speculative.speculation_loop import speculation_rounds
from speculative.target import TargetSession
from target_service.config import TargetConfig
from target_service.server import create_server as create_target_server
from tests.speculative.test_sampled_generation import _exact_target_distribution

GREEDY = SamplingParams(max_new_tokens=24)


class CountingVerifier(LocalVerifier):
    """LocalVerifier that overlaps (as across the network) and counts proposals sent
    ahead, and those abandoned."""

    def __init__(self, target):
        super().__init__(target, overlaps=True)
        self.ahead = self.abandoned = 0

    def send(
        self, base_len, draft_token_ids, draft_probs, expected_last_token_id=None, parents=None
    ):
        self.ahead += expected_last_token_id is not None
        super().send(base_len, draft_token_ids, draft_probs, expected_last_token_id, parents)

    def abandon_last(self):
        self.abandoned += 1
        super().abandon_last()


def _run(loaded, drafter, prompt, params, k, verifier_type=CountingVerifier):
    """(tokens, verifier, target, draft) of one pipelined call in process."""
    target = TargetSession(loaded, prompt, params)
    draft = drafter.open(prompt, params)
    verifier = verifier_type(target)
    tokens = []
    for result in speculation_rounds(
        verifier, draft, len(prompt), params, FixedK(k), loaded.context_length
    ):
        tokens += result.token_ids
        # the draft may hold a proposal ahead
        assert draft.length >= target.length == len(prompt) + len(tokens)
    return tokens, verifier, target, draft


@pytest.fixture(scope="module")
def drafters(tiny_target, tiny_perturbed, tiny_unrelated):
    perturbed = ModelDrafter(tiny_perturbed)
    return {
        "same": ModelDrafter(tiny_target),
        "perturbed": perturbed,
        "unrelated": ModelDrafter(tiny_unrelated),
        "ngram": NgramDrafter(),
        "ngram+model": LookupThenModelDrafter(perturbed, NgramDrafter()),
    }


@pytest.fixture(scope="module")
def references(tiny_target, prompt_ids):
    plain = SpeculativeGenerator(tiny_target)
    return [plain.generate(ids, GREEDY, k=0).token_ids for ids in prompt_ids]


@pytest.mark.parametrize("name", ["same", "perturbed", "unrelated", "ngram", "ngram+model"])
def test_pipelined_greedy_equals_target_only_for_every_drafter_and_k(
    name, drafters, tiny_target, prompt_ids, references
):
    ahead = abandoned = 0
    for k in range(1, 7):
        for ids, reference in zip(prompt_ids, references):
            tokens, verifier, _, _ = _run(tiny_target, drafters[name], ids, GREEDY, k)
            assert tokens == reference, (name, k, ids)
            ahead, abandoned = ahead + verifier.ahead, abandoned + verifier.abandoned
    assert ahead > 0  # the path under test ran
    if name in ("perturbed", "unrelated", "ngram+model"):
        assert 0 < abandoned < ahead or name == "unrelated" and abandoned > 0
    if name == "same":
        assert abandoned == 0  # its own weights: every guess right


class EarlyVerdicts(CountingVerifier):
    """Its verdicts come while the draft is drafting ahead, after every `every` tokens:
    a costly drafter then sends the shorter proposal it has."""

    every = 2

    def __init__(self, target):
        super().__init__(target)
        self.asked = 0
        self.ahead_sizes: list[int] = []

    def verdict_came(self) -> bool:
        self.asked += 1
        return self.asked % (self.every + 1) == 0

    def send(
        self, base_len, draft_token_ids, draft_probs, expected_last_token_id=None, parents=None
    ):
        if expected_last_token_id is not None:
            self.ahead_sizes.append(len(draft_token_ids))
        super().send(base_len, draft_token_ids, draft_probs, expected_last_token_id, parents)


@pytest.mark.parametrize("name", ["same", "perturbed", "ngram+model"])
def test_a_verdict_that_comes_while_drafting_ahead_sends_what_is_drafted_and_stays_exact(
    name, drafters, tiny_target, prompt_ids, references
):
    sizes = []
    for k in range(2, 7):
        for ids, reference in zip(prompt_ids, references):
            tokens, verifier, target, draft = _run(
                tiny_target, drafters[name], ids, GREEDY, k, EarlyVerdicts
            )
            assert tokens == reference, (name, k, ids)
            assert target.length == len(ids) + len(tokens)
            sizes += verifier.ahead_sizes
    assert sizes and max(sizes) <= EarlyVerdicts.every  # never drafted on past a verdict that came
    if name == "same":
        assert verifier.abandoned == 0  # cut short, its proposals still follow the target


def test_a_seeded_sampling_call_drafts_whole_proposals_ahead_so_its_draws_do_not_depend_on_timing(
    drafters, tiny_target, prompt_ids
):
    params = SamplingParams(temperature=1.0, top_k=8, seed=7, max_new_tokens=24)
    runs = [
        _run(tiny_target, drafters["same"], prompt_ids[0], params, 4, verifier_type)
        for verifier_type in (CountingVerifier, EarlyVerdicts)
    ]
    (tokens, _, _, _), (early_tokens, early, _, _) = runs
    assert early.ahead_sizes and all(size == 4 for size in early.ahead_sizes[:-1])
    assert early_tokens == tokens


def test_a_stop_token_inside_a_pipelined_round_ends_the_call(
    drafters, tiny_target, prompt_ids, references
):
    for ids, reference in zip(prompt_ids[:4], references):
        stop = SamplingParams(max_new_tokens=24, stop_token_ids=(reference[5],))
        expected = SpeculativeGenerator(tiny_target).generate(ids, stop, k=0).token_ids
        tokens, verifier, target, _ = _run(tiny_target, drafters["same"], ids, stop, 3)
        assert tokens == expected and target.length == len(ids) + len(expected)


class WrongAfter(DraftSession):
    """Drafts the reference continuation of the target, but every proposal's token at
    draft position `wrong_at` is off by one: each round rejects there, while a proposal
    drafted ahead of it is in flight."""

    def __init__(
        self, reference: Sequence[int], prompt: Sequence[int], wrong_at: int, vocab_size: int
    ):
        self.reference, self.tokens = list(reference), list(prompt)
        self.wrong_at, self.vocab_size = wrong_at, vocab_size
        self.last_proposal = (-1, 0)  # (length after it, its size)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def propose(self, k: int, min_reach: float = 0.0) -> Proposal:
        # A guess (one token right after a proposal) is the proposal's position k.
        end, size = self.last_proposal
        first = size if k == 1 and end == self.length else 0
        truth = self.reference[self.length : self.length + k]
        proposal = [
            (t + 1) % self.vocab_size if first + i == self.wrong_at else t
            for i, t in enumerate(truth)
        ]
        self.tokens += proposal
        self.last_proposal = (self.length, k)
        return Proposal(proposal)

    def append(self, token_ids):
        self.tokens += token_ids

    def truncate_to(self, length):
        del self.tokens[length:]


def test_a_rejection_with_a_proposal_in_flight_discards_it_in_process(
    tiny_target, prompt_ids, references
):
    ids = prompt_ids[0]
    target = TargetSession(tiny_target, ids, GREEDY)
    draft = WrongAfter(ids + references[0], ids, wrong_at=2, vocab_size=tiny_target.vocab_size)
    verifier = CountingVerifier(target)
    tokens = []
    for result in speculation_rounds(
        verifier, draft, len(ids), GREEDY, FixedK(4), tiny_target.context_length
    ):
        tokens += result.token_ids
    assert tokens == references[0]
    # every one sent ahead was wrong
    assert verifier.ahead > 0 and verifier.abandoned == verifier.ahead
    assert draft.length == target.length == len(ids) + len(tokens)


# --- across gRPC: the target discards the proposal in flight -----------------------------


@pytest.fixture(scope="module")
def target_stub(tiny_target):
    service = create_target_server(TargetConfig(address="127.0.0.1:0"), loaded_model=tiny_target)
    service.start()
    address = f"127.0.0.1:{service.port}"
    channel = grpc.insecure_channel(address)
    yield target_pb2_grpc.TargetServiceStub(channel), address
    channel.close()
    service.server.stop(0)


class RecordingRemoteVerifier(RemoteVerifier):
    """Records every verdict it reads."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.verdicts = []

    def _next_verdict(self):
        verdict = super()._next_verdict()
        self.verdicts.append(verdict)
        return verdict


@pytest.mark.parametrize("wrong_at", [0, 2, 4])
def test_a_rejection_with_a_proposal_in_flight_is_discarded_by_the_target(
    target_stub, tiny_target, prompt_ids, references, wrong_at
):
    """Proposal n is rejected at `wrong_at` (4: all accepted, the bonus is the target's
    and the guess, position 4, is wrong) while n + 1, drafted on the assumption that all
    of n was accepted, is already on the stream: the target answers it `discarded`,
    changing nothing; the output is exact and both sessions end at the committed length."""
    stub, address = target_stub
    ids = prompt_ids[1]
    handle = stub.OpenSession(
        target_pb2.OpenSessionRequest(prompt_token_ids=ids), timeout=30
    ).handle
    draft = WrongAfter(
        ids + references[1], ids, wrong_at=wrong_at, vocab_size=tiny_target.vocab_size
    )
    verifier = RecordingRemoteVerifier(
        stub,
        address,
        handle.session_id,
        GREEDY,
        first_round=0,
        deadline=Deadline(60),
        stall_timeout_s=30,
    )
    tokens = []
    try:
        for result in speculation_rounds(
            verifier, draft, len(ids), GREEDY, FixedK(4), tiny_target.context_length
        ):
            tokens += result.token_ids
    finally:
        verifier.close()
    assert tokens == references[1]
    discarded = [v for v in verifier.verdicts if v.WhichOneof("kind") == "discarded"]
    assert discarded and all(v.discarded.committed_len <= v.base_len for v in discarded)
    length = stub.Truncate(
        common_pb2.TruncateRequest(session_id=handle.session_id, length=len(ids) + len(tokens)),
        timeout=30,
    ).committed_len
    assert length == draft.length == len(ids) + len(tokens)
    stub.CloseSession(common_pb2.CloseSessionRequest(session_id=handle.session_id), timeout=30)


def test_the_remote_verifier_tells_when_a_verdict_came_without_waiting(
    target_stub, prompt_ids, references
):
    stub, address = target_stub
    ids = prompt_ids[2]
    handle = stub.OpenSession(
        target_pb2.OpenSessionRequest(prompt_token_ids=ids), timeout=30
    ).handle
    verifier = RemoteVerifier(
        stub,
        address,
        handle.session_id,
        GREEDY,
        first_round=0,
        deadline=Deadline(60),
        stall_timeout_s=30,
    )
    try:
        assert not verifier.verdict_came()  # nothing sent
        verifier.send(len(ids), references[2][:3], None)
        deadline = time.monotonic() + 30
        while not verifier.verdict_came():
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert verifier.receive().token_ids == references[2][:4]
        assert not verifier.verdict_came()
    finally:
        verifier.close()
    stub.CloseSession(common_pb2.CloseSessionRequest(session_id=handle.session_id), timeout=30)


# --- sampling: the pipelined tokens follow the target's distribution ----------------------

SAMPLED = SamplingParams(temperature=1.0, top_k=4, max_new_tokens=5)
NUM_RUNS = 1500
ALPHA = 1e-3  # false-fail probability of the test for a correct sampler


def _exact_last_three(loaded, prompt) -> dict[tuple[int, ...], float]:
    """P(y3, y4, y5): the target's distribution of the last three of five tokens (the
    ones pipelined proposals decide), summed over the first two, enumerated exactly."""
    marginal = Counter()
    for sequence, mass in _exact_target_distribution(loaded, prompt, SAMPLED).items():
        marginal[sequence[2:]] += mass
    return dict(marginal)


def _samples(loaded, drafter, prompt, num_runs) -> tuple[Counter, int]:
    """The last three of five sampled tokens per seeded run, and how many proposals sent
    ahead were verified."""
    samples, survived = Counter(), 0
    for seed in range(num_runs):
        tokens, verifier, _, _ = _run(loaded, drafter, prompt, SAMPLED.replace(seed=seed), 1)
        samples[tuple(tokens[2:])] += 1
        survived += verifier.ahead - verifier.abandoned
    return samples, survived


def _p_value(samples: Counter, exact: dict) -> float:
    """Chi-square goodness of fit; cells expected fewer than 5 times pooled into one."""
    if set(samples) - set(exact):
        return 0.0
    total = sum(samples.values())
    cells = [cell for cell in exact if exact[cell] * total >= 5]
    rest = [cell for cell in exact if cell not in cells]
    observed = [samples[c] for c in cells] + [sum(samples[c] for c in rest)]
    expected = [exact[c] * total for c in cells] + [sum(exact[c] for c in rest) * total]
    scale = total / sum(expected)
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


@pytest.fixture(scope="module")
def exact_last_three(tiny_target, prompt_ids):
    return _exact_last_three(tiny_target, prompt_ids[0])


def test_pipelined_sampling_follows_the_target_distribution(
    tiny_target, tiny_perturbed, prompt_ids, exact_last_three
):
    samples, survived = _samples(tiny_target, ModelDrafter(tiny_perturbed), prompt_ids[0], NUM_RUNS)
    assert survived > NUM_RUNS // 10, "proposals drafted ahead should often be verified"
    assert _p_value(samples, exact_last_three) > ALPHA


def test_the_pipelined_distribution_test_catches_a_biased_rule(
    tiny_target, tiny_perturbed, prompt_ids, exact_last_three, monkeypatch
):
    """Negative control: always accepting the draft token fails the same test."""
    monkeypatch.setattr(rejection, "acceptance_probability", lambda target_prob, draft_prob: 1.0)
    samples, _ = _samples(tiny_target, ModelDrafter(tiny_perturbed), prompt_ids[0], NUM_RUNS // 3)
    assert _p_value(samples, exact_last_three) < ALPHA


def test_a_seed_reproduces_a_pipelined_run(tiny_target, tiny_perturbed, prompt_ids):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=32)
    generator = SpeculativeGenerator(tiny_target, ModelDrafter(tiny_perturbed), pipelined=True)
    runs = [
        generator.generate(prompt_ids[7], params.replace(seed=seed), k=3).token_ids
        for seed in (11, 11, 12)
    ]
    assert runs[0] == runs[1] != runs[2]
