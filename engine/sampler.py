"""Logits -> token ids: penalties, logit bias, bans, temperature, top-k / top-p / min-p, seeded sampling and logprobs.

Runs in the model runner's worker thread once per step, so the work is vectorised over rows; Python loops run
over rows only where a row needs its own data (token lists, seeded generators, a filter check on one token).

Measured on this CPU for 32 x 49152 float32 logits on one thread: torch.argmax, cumsum and topk cost
1.3-2.5 ms, a bool mask from a comparison 0.7 ms, a full sort over 100 ms and an exponential race
(argmax(p / q), q ~ Exp(1)) 30 ms of random numbers, while amax and sum over blocks cost under 0.1 ms. So:
- argmax, top-n and sampling reduce blocks of columns first (amax or sum), then scan only the chosen blocks;
- sampling draws one uniform number per row and walks that row's CDF, block sums first;
- top-k and min-p zero what they drop, row by row (the k-th value comes from the blocked top-n);
- top-p works by rejection (as FlashInfer does), not by sorting: sample, accept the token if the tokens more
  likely than it hold less than top_p of the mass (usually a scalar test, else one pass over one row),
  otherwise zero every token no more likely than it (none of them is in the nucleus) and sample again.

Rows without top-k or min-p take the same steps in the native extension (`sample_rows`: one pass per row, 4-11x
faster at 8-32 rows); rows with them, and builds without the extension, take the PyTorch path here.

The sampler is total: for any finite parameters every row yields a token in bounded time. Penalties and
temperatures at the float edges can overflow logits to inf or NaN; those are made finite (NaN: never chosen)
before the softmax, a row with nothing left samples uniformly, and rejection sampling gives up after
_MAX_TOP_P_ROUNDS for an exact top-p by sorting the rows still pending.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.batch import SampledToken, SamplingRow
from engine.grammar_mask import GrammarMasker

_BLOCK = 256  # argmax and sampling: one block per row is scanned
_TOPK_BLOCK = 64  # top-n: n blocks per row are scanned
_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
# Below this a temperature would overflow logits / temperature; such rows are greedy (as in vLLM).
_MIN_TEMPERATURE = 1e-5
# Rejection rounds for top-p; each zeroes at least the rejected token, and a few rounds nearly always do.
_MAX_TOP_P_ROUNDS = 16
_FLOAT32_MAX = torch.finfo(torch.float32).max


def row_seed(seed: int, num_output_tokens: int) -> int:
    """The generator seed of a seeded row's step: depends on (seed, num_output_tokens) only (splitmix64)."""
    h = (seed * 0x9E3779B97F4A7C15 + num_output_tokens) & _MASK64
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
    # torch's CPU generator keeps only the low 32 bits of its seed: the mixing spreads every input bit there.
    return (h ^ (h >> 31)) & _MASK63


def _is_greedy(row: SamplingRow) -> bool:
    return row.is_greedy or row.temperature < _MIN_TEMPERATURE


def _select_rows(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """x[idx] as a new tensor (index_select: several times faster than indexing with a list); x when idx is all."""
    if len(idx) == x.shape[0]:
        return x
    return x.index_select(0, torch.tensor(idx, dtype=torch.long))


def _flat_keys(token_lists: Sequence[tuple[int, Sequence[int]]], vocab: int) -> torch.Tensor:
    """(row, token ids) pairs -> row * vocab + token for each token below vocab: indices into [N, V] viewed flat."""
    flat = array("q")
    for _, tokens in token_lists:
        flat.extend(tokens)  # array + frombuffer: about 7x faster than torch.tensor(list)
    if not flat:
        return torch.empty(0, dtype=torch.long)
    tokens_t = torch.frombuffer(flat, dtype=torch.long)
    offsets = torch.tensor([row * vocab for row, _ in token_lists])
    keys = tokens_t + offsets.repeat_interleave(torch.tensor([len(tokens) for _, tokens in token_lists]))
    if int(tokens_t.max()) >= vocab:
        keys = keys[tokens_t < vocab]
    return keys


def apply_penalties_(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place on contiguous [N, V] logits: repetition (prompt and output tokens), then frequency and presence
    (output tokens). Only the logits of tokens that occur are read and written."""
    idx = [i for i, row in enumerate(rows) if row.has_penalties]
    if not idx:
        return
    vocab = logits.shape[1]
    flat = logits.view(-1)
    out_keys = _flat_keys([(i, rows[i].output_token_ids) for i in idx], vocab)
    prompt_keys = _flat_keys([(i, rows[i].prompt_token_ids) for i in idx if rows[i].repetition_penalty != 1], vocab)
    keys = torch.cat([out_keys, prompt_keys])
    if not keys.numel():
        return
    # Distinct (row, token) pairs, counting output occurrences only.
    unique, inverse = torch.unique(keys, return_inverse=True)
    counts = torch.bincount(inverse[: out_keys.numel()], minlength=unique.numel()).to(logits.dtype)
    row_t = unique // vocab

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(r, name) for r in rows], dtype=logits.dtype).index_select(0, row_t)

    values = flat.index_select(0, unique)
    rep = per_row("repetition_penalty")
    values = torch.where(values > 0, values / rep, values * rep)  # rep == 1 leaves a value exactly as it was
    values = values - per_row("frequency_penalty") * counts - per_row("presence_penalty") * (counts > 0)
    flat.index_copy_(0, unique, values)


def apply_logit_bias_(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place on contiguous [N, V] logits: each row's logit_bias added to its tokens (ids inside V). Rows
    without biases cost nothing; the rest are one index_add_ over the biased entries."""
    biased = [(i, r.logit_bias) for i, r in enumerate(rows) if r.logit_bias]
    if not biased:
        return
    vocab = logits.shape[1]
    keys = [i * vocab + token for i, bias in biased for token in bias if token < vocab]
    values = [value for _, bias in biased for token, value in bias.items() if token < vocab]
    if keys:
        flat = logits.view(-1)
        flat.index_add_(0, torch.tensor(keys, dtype=torch.long), torch.tensor(values, dtype=logits.dtype))


def apply_bans_(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place on contiguous [N, V] logits: each row's banned_token_ids (those inside V) become -inf."""
    keys = _flat_keys([(i, r.banned_token_ids) for i, r in enumerate(rows) if r.banned_token_ids], logits.shape[1])
    if keys.numel():
        logits.view(-1).index_fill_(0, keys, float("-inf"))


def _block_reduce(x: torch.Tensor, op: Callable[..., torch.Tensor], block: int = _BLOCK) -> torch.Tensor:
    """[R, V] -> [R, ceil(V / block)]: op (torch.amax or torch.sum) over consecutive blocks of columns."""
    rows, vocab = x.shape
    full = vocab // block * block
    parts = []
    if full:
        parts.append(op(x[:, :full].view(rows, -1, block), dim=-1))
    if full < vocab:
        parts.append(op(x[:, full:], dim=-1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _block_columns(blocks: torch.Tensor, vocab: int, block: int = _BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, n] block numbers -> ([R, n * block] column indices, valid mask); a short last block repeats V - 1."""
    cols = (blocks * block).unsqueeze(-1) + torch.arange(block)
    cols = cols.flatten(1)
    return cols.clamp(max=vocab - 1), cols < vocab


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) (the first maximum; a NaN is the maximum) for [R, V]: one native pass a row where
    the extension is built (a greedy decode's every step: ~6 us a 49k row against ~125 for torch's few calls), else
    block maxima, then one block per row."""
    ops = _native_ops()
    if ops is not None and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] and x.stride(1) == 1:
        return ops.argmax_rows(x)
    cols, _ = _block_columns(_block_reduce(x, torch.amax).argmax(dim=-1, keepdim=True), x.shape[1])
    return cols.gather(1, x.gather(1, cols).argmax(dim=-1, keepdim=True)).squeeze(1)


def topk_rows(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) for [R, V]: the k largest lie in the k blocks with the largest maxima."""
    if k * _TOPK_BLOCK * 4 > x.shape[1]:
        return x.topk(k, dim=-1)
    blocks = _block_reduce(x, torch.amax, _TOPK_BLOCK).topk(k, dim=-1).indices
    cols, valid = _block_columns(blocks, x.shape[1], _TOPK_BLOCK)
    values, pos = x.gather(1, cols).masked_fill_(~valid, float("-inf")).topk(k, dim=-1)
    return values, cols.gather(1, pos)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]) -> list[SampledToken]:
    """[R, V] float32 logits (the model's, unmodified), [R] token ids -> each token with its logprob and its
    row's num_top[i] most likely tokens (most likely first)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    k = min(max(num_top, default=0), logprobs.shape[1])
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k:
        values, ids = topk_rows(logprobs, k)
        top_values, top_ids = values.tolist(), ids.tolist()
    return [
        SampledToken(token, chosen[j], list(zip(top_ids[j][:n], top_values[j][:n])) if n else [])
        for j, (token, n) in enumerate(zip(token_ids.tolist(), num_top))
    ]


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[R, V] non-negative weights, [R] u in (0, 1] -> [R] the first column whose cumulative weight >= u * total."""
    cdf = _block_reduce(weights, torch.sum).cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    block = torch.searchsorted(cdf, target).clamp_(max=cdf.shape[1] - 1)
    before = cdf.gather(1, (block - 1).clamp(min=0)) * (block > 0)
    cols, valid = _block_columns(block, weights.shape[1])
    inner = (weights.gather(1, cols) * valid).cumsum(dim=-1)
    # target > before, so rest > 0 and the column found has positive weight; the cap absorbs rounding.
    rest = torch.minimum(target - before, inner[:, -1:])
    return cols.gather(1, torch.searchsorted(inner, rest).clamp_(max=_BLOCK - 1)).squeeze(1)


def _native_ops() -> ModuleType | None:
    """The native extension when it is built and on (sampling does not depend on the model's path), else None."""
    from engine.native import native_ops

    return native_ops()


def _cuts_top_k_or_min_p(row: SamplingRow, vocab: int) -> bool:
    return 0 < row.top_k < vocab or row.min_p > 0


def _finite(x: torch.Tensor) -> torch.Tensor:
    """[R, V] logits with NaN as -inf and +inf as the largest float; a row with no finite value becomes all 0
    (uniform), so that softmax always gives a distribution."""
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=_FLOAT32_MAX)
    is_empty = x.amax(dim=-1) == float("-inf")
    if bool(is_empty.any()):
        x[is_empty] = 0.0
    return x


def _sorted_top_p(probs: torch.Tensor, nucleus_masses: list[float]) -> torch.Tensor:
    """[R, V] weights -> the same weights with everything outside each row's nucleus zeroed (by sorting): a
    token stays when the tokens more likely than it hold less than the row's nucleus mass."""
    values, order = probs.sort(dim=-1, descending=True)
    mass_before = values.cumsum(dim=-1) - values
    keep = mass_before < torch.tensor(nucleus_masses, dtype=probs.dtype).unsqueeze(1)
    keep[:, 0] = True  # the most likely token is always in the nucleus
    return torch.zeros_like(probs).scatter_(1, order, values * keep)


class Sampler:
    """Chooses one token per row of [N, V] logits; see SamplingRow for the parameters.

    vocab_size: when the model's V is padded past the tokenizer's vocabulary, the padding columns are ignored.
    seed: seeds the generator used by rows without a seed (None: nondeterministic).
    """

    def __init__(self, vocab_size: int | None = None, seed: int | None = None) -> None:
        self.vocab_size = vocab_size
        self._grammar_masker: GrammarMasker | None = None  # made for the first constrained row
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} sampling rows")
        if self.vocab_size is not None and logits.shape[1] > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        is_caller_tensor = True
        if logits.dtype != torch.float32 or logits.stride(1) != 1:
            logits, is_caller_tensor = logits.float().contiguous(), False

        constrained = any(r.matcher is not None for r in rows)
        modified = any(r.has_penalties or r.banned_token_ids or r.logit_bias for r in rows)
        want_logprobs = any(r.num_logprobs is not None for r in rows)
        greedy = [i for i, r in enumerate(rows) if _is_greedy(r)]
        if len(greedy) == len(rows) and not modified and not constrained and not want_logprobs:
            return [SampledToken(t) for t in argmax_rows(logits).tolist()]

        work = logits
        if modified or constrained:
            if want_logprobs or is_caller_tensor:  # raw logits stay for the logprobs (and for the caller)
                work = logits.clone(memory_format=torch.contiguous_format)
            apply_penalties_(work, rows)
            apply_logit_bias_(work, rows)
            apply_bans_(work, rows)
            if constrained:
                if self._grammar_masker is None:
                    self._grammar_masker = GrammarMasker()
                self._grammar_masker.apply_(work, rows)

        if len(greedy) == len(rows):
            tokens = argmax_rows(work)
        elif not greedy:
            tokens = self._sample(work, rows)
        else:
            sampled = [i for i, r in enumerate(rows) if not _is_greedy(r)]
            tokens = torch.empty(len(rows), dtype=torch.long)
            tokens[greedy] = argmax_rows(_select_rows(work, greedy))
            tokens[sampled] = self._sample(_select_rows(work, sampled), [rows[i] for i in sampled])

        if not want_logprobs:
            return [SampledToken(t) for t in tokens.tolist()]
        return self._with_logprobs(logits, rows, tokens)

    def _sample(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """[S, V] penalised logits of non-greedy rows -> [S] token ids: rows without top-k or min-p in the native
        extension's one pass per row (when it is built), the others here."""
        ops = _native_ops()
        native = [j for j, r in enumerate(rows) if ops is not None and not _cuts_top_k_or_min_p(r, x.shape[1])]
        if not native:
            return self._sample_torch(x, rows)
        tokens = torch.empty(len(rows), dtype=torch.long)
        rest = sorted(set(range(len(rows))) - set(native))
        if rest:
            tokens[rest] = self._sample_torch(_select_rows(x, rest), [rows[j] for j in rest])
        tokens[native] = self._sample_native(ops, _select_rows(x, native), [rows[j] for j in native])
        return tokens

    def _sample_native(self, ops: ModuleType, x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The extension's sample_rows: per row, softmax weights, one uniform number's token on their cumulative
        sum, top-p by rejection with a new number per round (the same steps as below). A row rejected in every round
        is sorted here."""
        generators = self._row_generators(rows)
        u = torch.rand(len(rows), _MAX_TOP_P_ROUNDS, generator=self._generator)
        for j, generator in generators.items():
            u[j] = torch.rand(_MAX_TOP_P_ROUNDS, generator=generator)
        temperatures = torch.tensor([r.temperature for r in rows], dtype=torch.float32)
        top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float32)
        tokens = ops.sample_rows(x.float().contiguous(), temperatures, top_p, torch.sub(1, u))
        unsettled = (tokens < 0).nonzero().flatten().tolist()
        if unsettled:
            scaled = _select_rows(x, unsettled).float() / temperatures[unsettled].unsqueeze(1)
            probs = torch.softmax(_finite(scaled), dim=-1)
            exact = _sorted_top_p(probs, [rows[j].top_p for j in unsettled])
            tokens[unsettled] = _inverse_cdf(exact, self._uniforms(unsettled, generators))
        return tokens

    @staticmethod
    def _row_generators(rows: Sequence[SamplingRow]) -> dict[int, torch.Generator]:
        """A generator per seeded row, seeded by (seed, num_output_tokens) only: the row's numbers do not depend on
        the batch."""
        return {
            j: torch.Generator().manual_seed(row_seed(row.seed, row.num_output_tokens))
            for j, row in enumerate(rows)
            if row.seed is not None
        }

    def _sample_torch(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        temperatures = [r.temperature for r in rows]
        if any(t != 1 for t in temperatures):
            x = x / torch.tensor(temperatures, dtype=x.dtype).unsqueeze(1)
        probs = torch.softmax(_finite(x), dim=-1)  # owned here: rejected tokens are zeroed in place
        generators = self._row_generators(rows)

        if any(_cuts_top_k_or_min_p(r, x.shape[1]) for r in rows):
            k_mass = self._cut_top_k_and_min_p_(probs, rows)
        else:
            k_mass = [1.0] * len(rows)
        if all(r.top_p >= 1 for r in rows):
            return _inverse_cdf(probs, self._uniforms(range(len(rows)), generators))

        tokens = [0] * len(rows)
        pending = list(range(len(rows)))
        for _ in range(_MAX_TOP_P_ROUNDS):
            if not pending:
                break
            weights = _select_rows(probs, pending)
            chosen = _inverse_cdf(weights, self._uniforms(pending, generators))
            chosen_p = weights.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
            rejected = []
            for j, token, p in zip(pending, chosen.tolist(), chosen_p):
                if self._in_nucleus(probs[j], p, rows[j].top_p, k_mass[j]):
                    tokens[j] = token
                else:
                    F.threshold_(probs[j], p, 0.0)  # zero every weight <= p: none of them is in the nucleus
                    rejected.append(j)
            pending = rejected
        if pending:
            # Rejections zeroed only tokens outside the nucleus, so the nucleus is whole in what is left.
            exact = _sorted_top_p(_select_rows(probs, pending), [rows[j].top_p * k_mass[j] for j in pending])
            chosen = _inverse_cdf(exact, self._uniforms(pending, generators))
            for j, token in zip(pending, chosen.tolist()):
                tokens[j] = token
        return torch.tensor(tokens, dtype=torch.long)

    @staticmethod
    def _cut_top_k_and_min_p_(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> list[float]:
        """Zero, in place, what top-k and min-p drop; returns each row's top-k mass (1 when top-k is off).

        min-p compares with the most likely token, so it does not matter that top-p comes between them.
        """
        floors = [0.0] * len(rows)
        masses = [1.0] * len(rows)
        kr = [j for j, r in enumerate(rows) if 0 < r.top_k < probs.shape[1]]
        if kr:
            ks = [rows[j].top_k for j in kr]
            values, _ = topk_rows(_select_rows(probs, kr), max(ks))
            last = torch.tensor(ks).unsqueeze(1) - 1
            # cumsum adds in order, so a row's mass does not depend on the other rows' k.
            k_masses = values.cumsum(dim=-1).gather(1, last).squeeze(1).tolist()
            for j, floor, mass in zip(kr, values.gather(1, last).squeeze(1).tolist(), k_masses):
                floors[j], masses[j] = floor, mass
        if any(r.min_p > 0 for r in rows):
            for j, p_max in enumerate(probs.amax(dim=-1).tolist()):
                floors[j] = max(floors[j], rows[j].min_p * p_max)
        # threshold_ zeroes values <= its argument: pass the float32 just below each floor, which stays in.
        below = torch.nextafter(torch.tensor(floors, dtype=probs.dtype), torch.zeros(())).tolist()
        for j, floor in enumerate(floors):
            if floor > 0:
                F.threshold_(probs[j], below[j], 0.0)
        return masses

    @staticmethod
    def _in_nucleus(row_probs: torch.Tensor, p: float, top_p: float, k_mass: float) -> bool:
        """Whether the tokens strictly more likely than one of probability p hold less than top_p of the mass.

        The mass is that of the top-k set (k_mass), inside which the more likely tokens all lie.
        """
        if top_p >= 1 or k_mass - p < top_p * k_mass:
            return True
        more_likely = F.threshold(row_probs, p, 0.0).sum().item()
        return more_likely == 0 or more_likely < top_p * k_mass  # a most likely token is always in

    def _uniforms(self, pending: Sequence[int], generators: dict[int, torch.Generator]) -> torch.Tensor:
        """[len(pending)] numbers in (0, 1]: a seeded row draws from its own generator, the rest from ours."""
        u = torch.rand(len(pending), generator=self._generator)
        for n, j in enumerate(pending):
            if j in generators:
                u[n] = torch.rand((), generator=generators[j])
        return torch.sub(1, u)

    @staticmethod
    def _with_logprobs(logits: torch.Tensor, rows: Sequence[SamplingRow], tokens: torch.Tensor) -> list[SampledToken]:
        lp_rows = [i for i, r in enumerate(rows) if r.num_logprobs is not None]
        # The raw logits: logprobs describe the model's distribution, not the sampling one.
        scored = token_logprobs(
            _select_rows(logits, lp_rows), _select_rows(tokens, lp_rows), [rows[i].num_logprobs or 0 for i in lp_rows]
        )
        out = [SampledToken(t) for t in tokens.tolist()]
        for j, i in enumerate(lp_rows):
            out[i] = scored[j]
        return out
