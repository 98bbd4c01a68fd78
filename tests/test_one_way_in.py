"""One way in (issue 63 item 1): the same heads through an activation file (``kpca_records``) and
through arrays in memory (``analyze_heads``) give the same records and the same solver draws, bit
for bit, in both variants: a vision file, a text file with padding (grouped-query heads), a
decoder's file (causal, grouped-query, padding on either side); and the job's draw counts have one
form."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from test_activations import _causal_gqa_layers, _two_sided_mask, write_gqa, write_hand_vit

from kpca_repro import HeadArrays, KpcaJob, analyze_heads
from kpca_repro.activations import ActivationFile, repeat_kv_map, write_activations
from kpca_repro.method.records import kpca_records
from kpca_repro.method.variant import get as get_variant


def _write_decoder(path):
    layers, mask = _causal_gqa_layers(mask=_two_sided_mask())
    write_activations(path, layers, model_id="decoder", attention_mask=mask, causal=True, kv_head_of_query=repeat_kv_map(4, 2))


WRITERS = {"vision": write_hand_vit, "text with padding": write_gqa, "decoder": _write_decoder}


def _layer_arrays(af: ActivationFile, layer: int) -> HeadArrays:
    """One layer of an open file as arrays in memory, with the file's mask, heads layout and input numbers."""
    t = af.read(layer)
    return HeadArrays(
        t["q"],
        t["k"],
        t["v"],
        t["h"],
        attention_mask=af.attention_mask,
        causal=af.causal,
        kv_head_of_query=af.kv_head_of_query,
        sample_rank=af.sample_rank,
        dataset_index=af.dataset_index,
        layer=layer,
    )


@pytest.mark.parametrize("variant", ["paper", "corrected"])
@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_a_file_and_its_arrays_give_the_same_records_and_draws(tmp_path, kind, variant):
    path = tmp_path / "heads.h5"
    WRITERS[kind](path)
    # the paper variant's solver draws (with Table 1's pruning of matched draws for vision heads)
    draws_wanted = (8, 4) if get_variant(variant).sign_draws else (0, 0)
    with ActivationFile(path) as af:
        layers = range(af.n_layers)
        arrays = [_layer_arrays(af, layer) for layer in layers]
    for layer, heads in zip(layers, arrays):
        job = KpcaJob(variant, heads_per_chunk=3, seed=5, layers=(layer,), sign_draws=draws_wanted)
        from_file, meta, file_draws = kpca_records(path, job)
        from_arrays, array_draws = analyze_heads(heads, job)
        assert len(from_file) > 0 and (from_file["layer"] == layer).all()
        pd.testing.assert_frame_equal(from_file.drop(columns="model"), from_arrays, check_exact=True)
        assert file_draws.keys() == array_draws.keys()
        for name, drawn in file_draws.items():
            assert drawn.shape[0] == len(from_file)
            np.testing.assert_array_equal(drawn, array_draws[name], err_msg=name)
        assert file_draws["direct_cos_mean"].shape[1] == draws_wanted[0]
        assert "sign_draws" not in meta  # the draws are a value of their own, never inside the metadata


def test_a_decoder_prefix_profile_is_the_same_from_a_file_and_its_arrays(tmp_path):
    path = tmp_path / "decoder.h5"
    _write_decoder(path)
    with ActivationFile(path) as af:
        heads = _layer_arrays(af, 1)
    for prefix in (3, 5):
        job = KpcaJob("corrected", layers=(1,), prefix=prefix)
        from_file, meta, _ = kpca_records(path, job)
        from_arrays, _ = analyze_heads(heads, job)
        assert meta["prefix"] == prefix and (from_file["n_tokens"] == prefix).all()
        pd.testing.assert_frame_equal(from_file.drop(columns="model"), from_arrays, check_exact=True)


def test_the_draw_counts_have_one_form():
    """``(0, 0)`` is no draws (the rule's form for a variant without them); any pair of counts
    becomes a tuple of ints; anything else is refused in one line naming it."""
    assert KpcaJob().sign_draws == (0, 0) and not KpcaJob().draws_wanted
    job = KpcaJob(sign_draws=[np.int64(16), 2])
    assert job.sign_draws == (16, 2) and type(job.sign_draws[0]) is int and job.draws_wanted
    for bad in ((1, 2, 3), (-1, 0)):
        with pytest.raises(ValueError, match=r"^sign_draws=.*two counts >= 0"):
            KpcaJob(sign_draws=bad)
    assert KpcaJob.of("corrected").variant.name == "corrected" and KpcaJob.of(job) is job
