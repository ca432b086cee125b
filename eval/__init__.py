"""Evaluation of frozen backbones, pictures of their features, and the commands that read finished runs.

- features.py     extract_features and the on-disk feature cache (features_for)
- memory.py       every feature bank sized to the machine's memory before it is built
- knn.py          knn_classify / knn_evaluate (DINO protocol, exact, FAISS or torch),
                  online_knn for trainers, and the `knn` command
- linear.py       the `linear` command and its two protocols: lbfgs (logreg.py: logistic
                  regression at its optimum, the L2 held out) and DINO's (many lrs at once)
- few_labels.py   banks of n labeled images per class, drawn `tries` times (knn, linear)
- judge.py        the DINO trainer's k-NN and linear probe: the labeled set (eval.data),
                  when it runs, the health-only run without labels
- viz.py          cross-patch rows, sparsity, training curves and the two pictures below:
                  the `viz` command
- neighbours.py   a few test images with the k-NN's own nearest training images
- patch_pca.py    patch tokens before pooling on their first principal components
- export.py       a run's backbone for timm / the official code / safetensors: `export`
- figure.py       a matplotlib figure without pyplot (every picture above)
- command.py      what the knn / linear / viz commands share (backbone, features, output)

Checkpoints come in through resmlp.models.load. Import from the modules
(resmlp.eval.knn, ...); this file imports nothing so that a command pays only for what
it uses.
"""
