"""The MTP draft's exactness contract (issue 46) and the EXL3-against-dense-twin check, shared by the end-to-end
tests of each architecture with an MTP draft: one engine without speculation, one with the checkpoint's EXL3 draft,
and the dense twin (the checkpoint's reconstruction, fp32 in transformers) as the exact model. `models`: {1: (EXL3
dir, dense twin dir), 2: an unrelated model of the same shape}; `engines`: (plain engine's results, drafting's)."""
import functools

import torch
import transformers
from engine import finish, results, run_engine, start_engine

PROMPTS = ["w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12", "w10 w20 w30 w40 w50", "w7", "w300 w2 w999 w4 w5",
           "w8 w8 w8 w8", "w42 w43", "w1000 w1 w100 w10", "w5 w6 w7 w8 w9", "w64 w65 w66", "w3 w1 w4 w1 w5 w9 w2 w6",
           "w77 w77", "w900 w800 w700 w600 w500 w400", "w12 w13", "w250 w251 w252 w253", "w1 w1 w2 w3 w5 w8 w13",
           "w600 w6"]  # 16 requests: the c=16


def engine_pair(ckpt, spec, tokens, vocab, engine, env=None, spec_extra=None):
    """Two engines at once, bf16: without speculation (every prompt's distributions and greedy tokens), and with the
    draft `spec` (the prompts together, then each alone). `engine`: both engines' LLM arguments; `spec_extra`: the
    drafting engine's own. Returns (plain results, drafting results)."""
    drafting = start_engine(ckpt, "bfloat16", PROMPTS, tokens, env=env,
                            extra={"speculative_config": spec, "full_decode_logprobs": vocab, "one_at_a_time": True,
                                   **engine, **(spec_extra or {})})
    plain = run_engine(ckpt, "bfloat16", PROMPTS, tokens, env=env,
                       extra={"full_prompt_logprobs": vocab, "full_decode_logprobs": vocab, "one_at_a_time": True,
                              **engine})
    return results(plain), results(finish(drafting))


@functools.lru_cache(maxsize=4)
def twin(dense):
    return transformers.AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)


def oracle(dense, ids):
    with torch.no_grad():
        return torch.log_softmax(twin(dense)(torch.tensor([ids])).logits[0].float(), -1)


def kl(p, q):
    return (p.exp() * (p - q)).sum(-1)


def as_tensor(rows, vocab):
    """An engine's full distributions (rows of [token, log-probability]) as a tensor."""
    lp = torch.full((len(rows), vocab), float("-inf"))
    for t, row in enumerate(rows):
        tok, val = zip(*row)
        lp[t, list(tok)] = torch.tensor(val)
    return lp


def check_dense_twin(models, plain, vocab):
    """The plain engine's prompt distributions against the dense twin's (KL, beside an unrelated model of the same
    shape: the scale a wrong load reaches), and its greedy tokens the twin's argmax while the twin's margin is clear."""
    dense = models[1][1]
    for r in plain:
        ids = r["prompt_ids"]
        lp = as_tensor(r["prompt_dists"], vocab)
        want = oracle(dense, ids)[:-1]
        ours, unrelated = kl(want, lp).mean().item(), kl(want, oracle(models[2][1], ids)[:-1]).mean().item()
        print(f"mean KL vs the dense twin {ours:.2e}; an unrelated model {unrelated:.2e}")
        assert ours <= 1e-3 and ours <= 0.01 * unrelated
        # Greedy tokens are the twin's argmax while its top-2 margin exceeds bf16's noise.
        logits = oracle(dense, ids + r["tokens"])
        for i, tok in enumerate(r["tokens"]):
            top2 = torch.topk(logits[len(ids) - 1 + i], 2)
            if (top2.values[0] - top2.values[1]).item() < 0.1:
                break
            assert tok == int(top2.indices[0]), f"token {i}: vLLM {tok}, twin {int(top2.indices[0])}"


def check_mtp_contract(models, engines, vocab):
    """vLLM's MTP draft runs on the checkpoint's EXL3 MTP modules; verification sends k + 1 rows per sequence
    through the main model. The draft's weights are random, so nearly all its tokens are
    rejected: this checks that the draft runs and changes nothing, not its acceptance.
    First, the verifier's distribution at every generated token matches the dense twin's as the plain engine's does
    (a wrong verification, such as stale linear-attention state, reaches an unrelated model's scale). Then greedy
    output is the plain engine's, 16 requests together and each alone, tie-aware as bench/serve_gpu/exactness.py is:
    where they part, the plain engine's own margin between the two tokens is a near tie: under bf16's tie margin
    (0.125, as in the corpus gate) or, where larger, what the two engines' rounding measurably reaches on this model
    before they part: the largest difference in the log-probability of the same token from the same context, or the
    sum of each engine's largest error in its top-2 margin against the fp32 twin's (the two may err in opposite
    directions; on the CPU engine each reached 0.13, 2026-12-07)."""
    plain, runs = engines
    dense, other = models[1][1], models[2][1]
    print("spec decode counters:", runs[0].get("spec_decode"))
    assert runs[0]["spec_decode"]["vllm:spec_decode_num_draft_tokens"] > 0
    # vLLM gives the draft the model's head; the draft's own, built for it, must be freed (an EXL3 head left alive:
    # 0.9 GiB of the 27B shape's memory, 2026-12-07).
    assert runs[0]["live_heads"] == 1, f"{runs[0]['live_heads']} output heads alive: the draft's own was not freed"
    for r in runs:
        seq, start = r["prompt_ids"] + r["tokens"], len(r["prompt_ids"]) - 1
        want = oracle(dense, seq)[start:-1]
        each = kl(want, as_tensor(r["decode_dists"], vocab))
        ours = each.mean().item()
        unrelated = kl(want, oracle(other, seq)[start:-1]).mean().item()
        print(f"drafting engine, generated tokens: mean KL vs the dense twin {ours:.2e} (largest {each.max():.2e} at "
              f"token {int(each.argmax())}); an unrelated model {unrelated:.2e}")
        assert ours <= 1e-3 and ours <= 0.01 * unrelated
    noise = max((abs(logprob(p, i, t) - logprob(r, i, t)) for p, r in zip(plain, runs)
                 for i, t in enumerate(p["tokens"][:parts_at(p["tokens"], r["tokens"])])), default=0.0)
    errs = margin_errors(dense, plain, plain, runs), margin_errors(dense, runs, plain, runs)
    tie = max(0.125, noise, sum(errs))
    print(f"largest difference between the engines before they part {noise:.3f}; largest error of each engine's "
          f"top-2 margin against the fp32 twin's: plain {errs[0]:.3f}, drafting {errs[1]:.3f}; tie margin {tie:.3f}")
    for p, r in zip(plain, runs):
        for tokens in (r["tokens"], r["alone_tokens"]):
            i = parts_at(p["tokens"], tokens)
            if i < len(tokens):
                margin = logprob(p, i, p["tokens"][i]) - logprob(p, i, tokens[i])
                own = logprob(r, i, tokens[i]) - logprob(r, i, p["tokens"][i]) if tokens is r["tokens"] else None
                print(f"parted at token {i} ({'together' if own is not None else 'alone'}): plain engine's margin "
                      f"{margin:.3f}, the fp32 twin's {twin_margin(dense, p, i, tokens[i]):.3f}"
                      + (f", the drafting engine's for its own token {own:.3f}" if own is not None else ""))
                assert margin < tie, f"parted beyond a near tie (margin {margin:.3f}): {tokens} / {p['tokens']}"


def parts_at(a, b):
    """The first position where two token lists differ (their length if they do not)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def margin_errors(dense, engine, plain, runs):
    """The largest difference between an engine's and the fp32 twin's margin between the plain engine's token and
    its runner-up, at the positions where both engines still agree: that engine's rounding noise on this model."""
    worst = 0.0
    for e, p, r in zip(engine, plain, runs):
        lp = oracle(dense, p["prompt_ids"] + p["tokens"])[len(p["prompt_ids"]) - 1:]
        for i in range(parts_at(p["tokens"], r["tokens"])):
            a, b = (t for t, _ in sorted(p["decode_dists"][i], key=lambda tv: -tv[1])[:2])
            worst = max(worst, abs(logprob(e, i, a) - logprob(e, i, b) - (lp[i, a] - lp[i, b]).item()))
    return worst


def logprob(r, i, token):
    """An engine's log-probability of token at its i-th generated position (full distributions returned)."""
    return dict(map(tuple, r["decode_dists"][i]))[token]


def twin_margin(dense, r, i, token):
    """The fp32 twin's margin between the engine's i-th generated token and token, from the same context."""
    lp = oracle(dense, r["prompt_ids"] + r["tokens"][:i])[-1]
    return (lp[r["tokens"][i]] - lp[token]).item()
