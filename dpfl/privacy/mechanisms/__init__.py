"""Privacy mechanisms: the noise a release adds (Gaussian, Laplace, sparse vector, DP-SGD's
event; Skellam, discrete Gaussian and binomial shares for SecAgg+; tree aggregation and
banded matrix factorization), their secret randomness and AADP-FL's longitudinal clip."""
