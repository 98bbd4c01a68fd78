"""Host memory of one vision extraction, batch by batch (docs/hub_fixture.md, "What costs what").

    python perf/extract_memory.py WEIGHTS IMAGE_DIR MODEL_ID N_IMAGES [--batch-size 25] [--threads 2]

Runs :func:`kpca_repro.capture.extraction.extract_vision` (the rule ``extract_vision``'s code) on CPU
over the first ``N_IMAGES`` images of the flat folder ``IMAGE_DIR`` (:func:`kpca_repro.inputs.images.list_images`, sorted by name) into a temporary HDF5 file.
Prints one line per batch: the process's resident memory (RSS, GiB) when the captured batch is handed
to the HDF5 writer (:meth:`kpca_repro.activations.ActivationWriter.add`), after a garbage collection; then the process's peak RSS (``ru_maxrss``,
GiB). The writer holds one batch while the next is computed, so from the second batch on two
batches of q, k, v, h are in memory: the peak depends on the batch size, not on ``N_IMAGES``.
"""

from __future__ import annotations

import argparse
import gc
import resource
import tempfile
from pathlib import Path

import pandas as pd
import psutil
import torch

import kpca_repro.capture.extraction as extraction
from kpca_repro.activations import ActivationWriter
from kpca_repro.inputs.images import list_images
from kpca_repro.inputs.resources import check_checksum


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("weights", type=Path, help="safetensors state_dict of the timm model")
    ap.add_argument("image_dir", type=Path, help="folder of images (*.JPEG, *.jpg, *.png)")
    ap.add_argument("model_id", help="timm model id, e.g. vit_large_patch16_224")
    ap.add_argument("n_images", type=int)
    ap.add_argument("--batch-size", type=int, default=25, help="vision.batch_size (default 25, the configuration's)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = ap.parse_args()
    records = list_images(args.image_dir, "flat")[: args.n_images]
    if len(records) < args.n_images:
        raise SystemExit(f"{args.image_dir} has {len(records)} images, fewer than {args.n_images}")
    samples = pd.DataFrame({"sample_rank": range(len(records)), "dataset_index": [r.dataset_index for r in records], "path": [r.path for r in records]})
    torch.set_num_threads(args.threads)

    add = ActivationWriter.add

    def add_and_report(writer, layers, mask=None):
        gc.collect()
        print(f"batch at image {writer.rows}: RSS {psutil.Process().memory_info().rss / 2**30:.2f} GiB", flush=True)
        return add(writer, layers, mask)

    ActivationWriter.add = add_and_report
    with tempfile.TemporaryDirectory() as tmp:
        extraction.extract_vision(args.model_id, args.weights, check_checksum(args.weights, None), samples, Path(tmp) / "a.h5", batch_size=args.batch_size, device=torch.device("cpu"), progress=False)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
