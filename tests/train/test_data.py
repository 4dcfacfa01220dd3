"""Data: the synthetic bigram-copy task, packed windows and their options, corpus and tokenizer."""

from collections import Counter

import numpy as np
import pytest
import torch

from analysis.train import TrainConfig
from analysis.model.reference.data import PackedCorpus, SyntheticBigramCopy, build_data, stdlib_docstrings, train_bpe


def synthetic(**kw):
    return SyntheticBigramCopy(TrainConfig(dataset="synthetic", **kw), n_ctx=64)


def test_synthetic_sequences_follow_the_task():
    data = synthetic()
    x = data.batch(0, 64).inputs
    assert torch.all(x[:, 0] == 0) and torch.all(x[:, 1:] >= 1)  # BOS then content tokens
    trig = set(data.triggers.tolist())
    n_copies = 0
    for row in x.tolist():
        assert row[1] not in trig
        for t in range(2, len(row) - 1):
            if row[t] in trig:
                assert row[t + 1] == row[t - 1]  # copy rule: the token before the trigger
                n_copies += 1
    assert n_copies > 100


def test_triggers_are_the_most_frequent_tokens_of_the_bigram_chain():
    data = synthetic(synthetic_triggers=3)
    chain = synthetic(synthetic_triggers=0)  # same transition matrix, no copy rule
    counts = Counter(chain.batch(1, 1024).inputs[:, 2:].flatten().tolist())
    top3 = {tok for tok, _ in counts.most_common(3)}
    assert top3 == set(data.triggers.tolist())


def test_non_trigger_transitions_follow_the_bigram_matrix():
    data = synthetic()
    x = data.batch(3, 512).inputs.numpy()
    a = int(np.argsort(-data.stationary)[5]) + 1  # a frequent non-trigger token
    assert a not in data.triggers
    nxt = [row[t + 1] for row in x for t in range(1, x.shape[1] - 1) if row[t] == a]
    emp = np.bincount(nxt, minlength=data.vocab_size)[1:] / len(nxt)
    assert len(nxt) > 500
    assert np.abs(emp - data.P[a - 1]).max() < 0.08


def test_batches_are_a_function_of_seed_and_step():
    a, b = synthetic(seed=1), synthetic(seed=1)
    torch.testing.assert_close(a.batch(5, 8).inputs, b.batch(5, 8).inputs)
    assert not torch.equal(a.batch(5, 8).inputs, a.batch(6, 8).inputs)
    assert not torch.equal(a.batch(5, 8).inputs, synthetic(seed=2).batch(5, 8).inputs)
    batch = a.batch(5, 8)
    torch.testing.assert_close(batch.inputs[:, 1:], batch.targets[:, :-1])
    # the held-out probe is fixed and differs from training batches
    torch.testing.assert_close(a.probe(10, 64), b.probe(10, 64))
    assert not torch.equal(a.probe(8, 64), batch.inputs)


def stream_source(**kw):
    tok = train_bpe(["hello world, the attention sink. " * 5, "packing windows of tokens " * 5] * 20, 300)
    ids = np.arange(5000, dtype=np.int32) % 250 + 1
    return PackedCorpus(TrainConfig(dataset="stdlib", seed=0, **kw), 16, ids, tok, "test")


def test_packed_windows_start_anywhere():
    data = stream_source()
    first = data.batch(0, 256).inputs[:, 0]
    assert len(set(first.tolist())) > 50  # arbitrary first tokens (random offsets)
    x = data.batch(0, 4)
    assert x.inputs.shape == (4, 16) and x.targets.shape == (4, 16)
    # consecutive ids in the stream stay consecutive in a window (no shuffling inside)
    d = (x.inputs[:, 1:] - x.inputs[:, :-1]) % 250
    assert torch.all((d == 1) | (x.inputs[:, 1:] == 1))


def test_bos_and_fixed_token_options():
    bos = stream_source(bos=True).batch(0, 8).inputs
    assert torch.all(bos[:, 0] == stream_source().bos_token_id)
    fixed = stream_source(fixed_token_position=3, fixed_token_id=7).batch(0, 8).inputs
    assert torch.all(fixed[:, 2] == 7) and fixed.shape == (8, 16)
    # the synthetic task with a fixed token at k: the chain starts at position 1 and BOS's place is k
    syn = synthetic(fixed_token_position=2, fixed_token_id=5).batch(0, 4).inputs
    assert torch.all(syn[:, 0] != 0) and torch.all(syn[:, 1] == 5)
    syn = synthetic(fixed_token_position=3).batch(0, 4).inputs
    assert torch.all(syn[:, 2] == 0) and not torch.any(syn[:, :2] == 0)
    # at position 1 a content token replaces BOS (no BOS anywhere); without an id it is BOS itself
    syn = synthetic(fixed_token_position=1, fixed_token_id=5).batch(0, 64).inputs
    assert torch.all(syn[:, 0] == 5) and not torch.any(syn == 0) and torch.any(syn[:, 1:] == 5)
    assert torch.all(synthetic(fixed_token_position=1).batch(0, 4).inputs[:, 0] == 0)


def test_prefix_lm_masks_the_loss_on_the_prefix():
    b = stream_source(prefix_len=5).batch(0, 4)
    # targets[:, j] is token j+1: tokens 1..4 (inside the prefix of 5) carry no loss, token 5 does
    assert torch.all(b.targets[:, :4] == -100) and torch.all(b.targets[:, 4:] != -100)


def test_stdlib_corpus_is_deterministic_and_tokenizes():
    docs = stdlib_docstrings(max_chars=50_000)
    assert docs == stdlib_docstrings(max_chars=50_000)
    assert sum(map(len, docs)) >= 50_000 and all(isinstance(d, str) and d for d in docs)
    tok = train_bpe(docs, 500)
    text = docs[0][:200]
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token_id is not None


def test_build_data_errors():
    with pytest.raises(ValueError, match="unknown dataset"):
        build_data(TrainConfig(dataset="wikipedia"), 16)
    with pytest.raises(FileNotFoundError, match="not found"):
        build_data(TrainConfig(dataset="tokens:/nonexistent.npy", tokenizer="x"), 16)


def test_induction_rule_on_keys():
    data = synthetic(synthetic_keys=6, synthetic_lags=3, fixed_token_position=1, fixed_token_id=6)
    keys, lag = data.keys.tolist(), data.lag
    assert (
        len(keys) == 6 and sorted(set(lag[keys].tolist())) == [1, 2, 3] and not set(keys) & set(data.triggers.tolist())
    )
    x = data.probe(64, 48).numpy()
    fired = 0
    for s in x:
        last = {}
        for t in range(1, len(s) - 1):
            c = int(s[t])
            if lag[c] and c in last and last[c] + lag[c] <= t and not data.is_trigger[c]:
                assert s[t + 1] == s[last[c] + lag[c]]  # what followed the key last time (lag tokens on) follows again
                fired += 1
            last[c] = t
    assert fired > 64  # the rule fires in most sequences
    plain = synthetic().batch(3, 8).inputs
    assert torch.equal(plain, synthetic(synthetic_lags=2).batch(3, 8).inputs)  # no keys: the task is unchanged
    with pytest.raises(ValueError, match="synthetic_keys"):
        synthetic(synthetic_keys=-1)
