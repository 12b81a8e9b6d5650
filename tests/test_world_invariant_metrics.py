"""Issue 41 item 0: equal training reports equal validation at any world size.

``trainer.limit_val_batches`` counts the world's batches (the global batch), so the GPT
preset (``limit_val_batches: 20``) and digits validate on the same first samples at world
sizes 1, 2 and 3 with one global batch of 12: ``val/loss`` agrees to float noise (~1e-6,
SGD keeps the weights within ~5e-8) and ``val/num_samples`` exactly. The expected count is
computed from the config, not read from a run: 20 x 12 windows x 128 tokens for the preset,
2 x 12 digits. One run per world size and data, shared by the assertions.
"""

from __future__ import annotations

import pytest
from helpers import QUIET, rel_close, run_once

# (world_size, per-rank batch): one global batch of 12
LAYOUTS = ((1, 12), (2, 6), (3, 4))
GPT = ("experiment=gpt_tokens", "optim=sgd", "optim.lr=0.05", "trainer.max_steps=8",
       "scheduler.warmup_steps=2",
       "trainer.epochs=1", "trainer.perf_metrics=false")
DIGITS = ("optim=sgd", "optim.lr=0.05", "trainer.max_steps=8", "trainer.epochs=1",
          "trainer.limit_val_batches=2", "trainer.perf_metrics=false")


def _runs(tmp_path_factory, name: str, overrides: tuple[str, ...]) -> list[dict]:
    """metrics.json of each layout, with the TensorBoard text sample (if any) as ``sample``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = []
    for world_size, batch in LAYOUTS:
        root = tmp_path_factory.mktemp(f"{name}-ws{world_size}")
        run = run_once(root, *overrides, f"world_size={world_size}",
                       f"data.batch_size={batch}", QUIET)
        (events,) = (run.job_dir / "tensorboard").glob("events.out.tfevents*")
        acc = EventAccumulator(str(events), size_guidance={"tensors": 0})
        acc.Reload()
        samples = ([e.tensor_proto.string_val[0] for e in acc.Tensors("samples/text_summary")]
                   if "samples/text_summary" in acc.Tags()["tensors"] else [])
        out.append({**run.metrics, "sample": samples})
    return out


@pytest.fixture(scope="module")
def gpt_runs(tmp_path_factory):
    return _runs(tmp_path_factory, "gpt", GPT)


@pytest.fixture(scope="module")
def digits_runs(tmp_path_factory):
    return _runs(tmp_path_factory, "digits", DIGITS)


@pytest.mark.slow
def test_gpt_preset_validates_on_the_same_windows_at_any_world_size(gpt_runs):
    """The preset as shipped (limit 20 global batches): 240 windows of 128 tokens at every
    world size (30720, 15360 and 10240 before the fix), and the same val/loss."""
    expected = 20 * 12 * 128
    assert [m["val/num_samples"] for m in gpt_runs] == [expected] * 3
    first = gpt_runs[0]
    assert len(first["sample"]) == 1  # rank 0's text sample, from a generator of (seed, epoch)
    for other in gpt_runs[1:]:
        for key in ("val/loss", "val/perplexity", "val/bits_per_byte", "train/epoch_loss"):
            assert rel_close(other[key], first[key], 1e-6), (key, first[key], other[key])
        for key in ("train/num_samples", "train/num_tokens", "global_step", "steps_per_epoch",
                    "global_batch_size", "sample"):
            assert other[key] == first[key], key


@pytest.mark.slow
def test_digits_validates_on_the_same_samples_at_any_world_size(digits_runs):
    """digits with trainer.limit_val_batches=2: the first 2 x 12 validation samples at every
    world size; val/loss and val/accuracy agree."""
    assert [m["val/num_samples"] for m in digits_runs] == [24] * 3
    first = digits_runs[0]
    for other in digits_runs[1:]:
        assert rel_close(other["val/loss"], first["val/loss"], 1e-6)
        assert other["val/accuracy"] == first["val/accuracy"]
        assert rel_close(other["train/epoch_loss"], first["train/epoch_loss"], 1e-6)
