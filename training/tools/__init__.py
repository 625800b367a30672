"""The training programs (layer 4: programs sit above the libraries they use): the train command's body
(:mod:`~dartree.training.tools.train`, behind the thin script ``training/train.py``), the data campaign
(``campaign``, ``campaign_train``), the GPU burst (``burst``, ``burst.sh``, ``burst_layout``), the parity check, the
data preparation, the training bench and the results page."""
