"""How much of a DINO checkpoint's features the k-NN protocol can see (docs/dino_learning.md).

    python studies/dino_learning_spectrum.py <checkpoint or run dir> [...]

For raw pixels and then each checkpoint's teacher backbone, on the eval transform of the
checkpoint's own training images (its data.subset) and the test images: the share of the
centered bank features' variance in their top direction, DINO's k-NN (cosine on the
features as they are, k=20, T=0.07), and the same k-NN after whitening the top WHITEN_DIMS
(64) directions of the bank's PCA. The whitened k-NN is a diagnostic of what the features
hold, not an evaluation protocol: the project reports DINO's.
"""
import os
import sys

import torch
from omegaconf import OmegaConf

import resmlp.data as rdata
from resmlp.eval.knn import knn_evaluate, online_knn
from resmlp.core.errors import UserError
from resmlp.models.load import load_backbone

DIMS = int(os.environ.get("WHITEN_DIMS", "64"))


def report(name, model, data_cfg):
    # the trainer's own k-NN (and its features): the "as is" figure is the demo's
    res = online_knn(model, data_cfg, torch.device("cpu"), ks=(20,), backend="torch",
                     amp_dtype=torch.float32, keep_features=True)
    (ftr, ytr), (fte, yte) = res["features"]["train"], res["features"]["test"]
    ftr, fte = ftr.double(), fte.double()
    mean = ftr.mean(0)
    _, s, v = torch.linalg.svd(ftr - mean, full_matrices=False)
    top = (s[0] ** 2 / (s ** 2).sum()).item()
    r = min(DIMS, len(s))
    whiten = v[:r].t() / (s[:r] / len(ftr) ** 0.5 + 1e-6)
    whitened = knn_evaluate(((ftr - mean) @ whiten).float(), ytr, ((fte - mean) @ whiten).float(), yte,
                            int(rdata.num_classes(data_cfg)), ks=(20,), backend="torch")[20]["top1"]
    print(f"{name}: top direction {top:.2f} of the variance; k-NN {res['knn_top1']:.2f} as is, "
          f"{whitened:.2f} whitened ({r} directions)", flush=True)


def main(paths):
    torch.set_grad_enabled(False)
    data_cfg = None
    for path in paths:
        model, info = load_backbone(path, key="teacher")
        if data_cfg is None:  # the first checkpoint's training data is every row's bank
            if not info.get("config"):
                raise UserError(f"{path}: no saved config to take the data from")
            data_cfg = OmegaConf.create(info["config"]).data
            report("raw pixels", torch.nn.Flatten(), data_cfg)
        report(path, model.eval(), data_cfg)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: " + __doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        sys.exit(2)
    try:
        main(sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
