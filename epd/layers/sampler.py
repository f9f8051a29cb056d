"""Token sampling: penalties, temperature, top-k, top-p, per-request seeds.

Greedy rows take the argmax. Random rows draw with the exponential-race trick
(argmax of p / E, E ~ Exp(1), equivalent to sampling from p), as vLLM v1's
``TopKTopPSampler`` does; a seeded request draws its noise from its own
``torch.Generator`` so its tokens do not depend on the rest of the batch.
Penalties follow the OpenAI API: logit -= presence * [count > 0] + frequency * count
over the tokens generated so far (``Sequence.all_output_token_ids``: a resumed
request's prior output included). ``skip_draws`` advances a seeded request's
generator as the sampler's draws would (a resumed request, or the prefill
worker's first token).
"""

from __future__ import annotations

import numpy as np
import torch

from epd.outputs import TokenLogprobs
from epd.sequence import Sequence


class Sampler:
    """Samples one token per row of ``logits`` ([n, vocab], fp32)."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], bitmask: np.ndarray | None = None,
                 rows: list[int] | None = None) -> list[int]:
        """One token per row. ``bitmask`` ([len(rows), ceil(vocab / 32)] int32, from
        ``epd.engine.grammar.GrammarCompiler.bitmask``) restricts rows ``rows`` to the tokens
        their grammar allows; ``logits`` itself is left unchanged (logprobs read it raw)."""
        logits = logits.float()
        if bitmask is not None:
            logits = logits.clone()
            apply_bitmask(logits, bitmask, rows)
        n, vocab = logits.shape
        params = [s.params for s in seqs]
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            logits = self._apply_penalties(logits, seqs)
        greedy = [p.greedy for p in params]
        out = logits.argmax(dim=-1)
        if all(greedy):
            return out.tolist()
        rows = [i for i in range(n) if not greedy[i]]
        sub = logits[rows]
        temps = torch.tensor([params[i].temperature for i in rows], dtype=torch.float32)
        sub = sub / temps[:, None]
        top_ks = [params[i].top_k for i in rows]
        top_ps = [params[i].top_p for i in rows]
        if any(0 < k < vocab for k in top_ks):
            k = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks])
            kth = sub.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            sub = sub.masked_fill(sub < kth, float("-inf"))
        if any(p < 1.0 for p in top_ps):
            sorted_logits, idx = sub.sort(dim=-1, descending=False)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            p = torch.tensor(top_ps, dtype=torch.float32)[:, None]
            # 1e-6 slack: fp32 rounding must not keep a token past an exact nucleus;
            # rows with top-p off lose nothing.
            drop = (cum <= (1 - p) + 1e-6) & (p < 1.0)
            drop[:, -1] = False  # always keep the most likely token
            sub = sub.masked_fill(drop.scatter(1, idx, drop), float("-inf"))
        probs = sub.softmax(dim=-1)
        noise = torch.empty_like(probs)
        seeded = [j for j, i in enumerate(rows) if seqs[i].generator is not None]
        if len(seeded) == len(rows):
            pass
        elif not seeded:
            noise.exponential_(generator=self.generator)  # one draw for the whole batch
        else:
            shared = [j for j, i in enumerate(rows) if seqs[i].generator is None]
            noise[shared] = torch.empty(len(shared), vocab).exponential_(generator=self.generator)
        for j in seeded:  # a seeded request's own draw: a [vocab] fp32 row (skip_draws replays it)
            noise[j].exponential_(generator=seqs[rows[j]].generator)
        out[rows] = (probs / noise).argmax(dim=-1)
        return out.tolist()

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        counts = torch.zeros_like(logits)
        for i, s in enumerate(seqs):
            out_ids = s.all_output_token_ids
            if out_ids:
                ids = torch.tensor(out_ids, dtype=torch.long)
                counts[i].scatter_add_(0, ids, torch.ones_like(ids, dtype=counts.dtype))
        presence = torch.tensor([s.params.presence_penalty for s in seqs])[:, None]
        frequency = torch.tensor([s.params.frequency_penalty for s in seqs])[:, None]
        return logits - presence * (counts > 0) - frequency * counts


def skip_draws(seq: Sequence, num_draws: int, vocab_size: int) -> None:
    """Advance ``seq``'s own generator past ``num_draws`` of the sampler's draws
    (one [vocab_size] fp32 exponential row per sampled token), so it samples as if it
    had drawn them itself. Nothing for a greedy or unseeded request (it draws none
    from its own generator)."""
    if seq.generator is None or seq.params.greedy:
        return
    row = torch.empty(vocab_size)
    for _ in range(num_draws):
        row.exponential_(generator=seq.generator)


def token_logprobs(logits: torch.Tensor, seqs: list[Sequence], token_ids: list[int]) -> list[TokenLogprobs | None]:
    """Log-probabilities of the sampled tokens for the rows that asked for them.

    ``logits``: [n, vocab] raw model logits (before penalties / temperature);
    ``token_ids``: the n sampled ids. Row i gets None unless
    ``seqs[i].params.logprobs`` is set (k >= 0), else the sampled token's
    log_softmax value and the k most likely tokens' (vLLM's default "raw"
    logprobs; OpenAI's ``logprobs`` / ``top_logprobs``).
    """
    rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(seqs)
    if not rows:
        return out
    lp = torch.log_softmax(logits[rows].float(), dim=-1)
    k = max(seqs[i].params.logprobs for i in rows)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    for j, i in enumerate(rows):
        ki = seqs[i].params.logprobs
        out[i] = TokenLogprobs(token_ids[i], float(lp[j, token_ids[i]]), top_i[j, :ki].tolist(),
                               top_v[j, :ki].tolist())
    return out


def apply_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
    """Set to -inf, in place, the logits of tokens a row's bitmask does not allow.

    ``logits``: [n, vocab] fp32; ``bitmask``: [len(rows), ceil(vocab / 32)] int32
    (``GrammarCompiler.bitmask``); ``rows``: the logits row of each bitmask row.
    """
    vocab = logits.shape[1]
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    idx = torch.tensor(rows, dtype=torch.long)
    sub = logits.index_select(0, idx)
    sub.masked_fill_(torch.from_numpy(allowed == 0), float("-inf"))
    logits.index_copy_(0, idx, sub)
