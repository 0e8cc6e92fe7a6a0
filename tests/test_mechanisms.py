"""Privacy mechanisms against closed forms and the libraries: each mechanism's output
(noise scale, clipping bound, at most c sparse-vector answers, the adaptive-clipping update)
and the epsilon of the event it returns (dp-accounting / Opacus built by hand here).

Tolerances: bit-identical where the same computation is repeated; for sampled statistics
a few standard errors (each assertion says which and the value measured with its seed)."""

import math

import pytest
import torch
from dp_accounting import dp_event
from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant
from opacus.accountants import RDPAccountant

from dpfl.privacy.accounting.events import PrivacyEvent, history_epsilon
from dpfl.privacy.mechanisms.longitudinal import longitudinal_clip
from dpfl.privacy.mechanisms.release import (
    DpsgdRelease,
    GaussianMechanism,
    LaplaceMechanism,
    QuantileClipTracker,
    SparseVector,
    l2_clip,
)

D = 1e-5


def _reference_clip_and_noise(update, clip_norm, noise_multiplier, generator, clip=None):
    """dpfl.client.trainers.clip_and_noise as of commit 8fd0684 (now replaced by the
    mechanism in the ClientApp), copied verbatim: the
    client's Gaussian mechanism the object must reproduce bit for bit."""
    if clip is not None:
        clipped = clip(update, clip_norm)
    else:
        norm = float(torch.linalg.vector_norm(update))
        clipped = update * min(1.0, clip_norm / norm) if norm > 0 else update.clone()
    noise = torch.randn(update.shape, generator=generator, dtype=update.dtype)
    return clipped + noise.to(update.device) * (noise_multiplier * clip_norm)


def _rdp(pairs):
    acc = RdpAccountant()
    for event, count in pairs:
        acc.compose(event, count)
    return acc.get_epsilon(D)


def _pld(pairs):
    acc = PLDAccountant()
    for event, count in pairs:
        acc.compose(event, count)
    return acc.get_epsilon(D)


@pytest.mark.parametrize("scale", [1e-3, 1.0, 100.0])
@pytest.mark.parametrize("custom", [False, True])
def test_gaussian_release_is_bit_identical_to_the_clients_clip_and_noise(scale, custom):
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(7)) * scale
    clip_fn = longitudinal_clip if custom else None
    ref = _reference_clip_and_noise(x, 0.5, 1.3, torch.Generator().manual_seed(11), clip_fn)
    out, event = GaussianMechanism(1.3, sensitivity=0.5, relation="replace-one",
                                   clip_fn=clip_fn).release(x, torch.Generator().manual_seed(11),
                                                            4)
    assert torch.equal(out, ref)
    assert event == PrivacyEvent.gaussian(4, 1.3, relation="replace-one")


def test_gaussian_noise_std_and_clip_bound():
    d, sigma, c = 200_000, 2.0, 0.25
    out, _ = GaussianMechanism(sigma, c).release(torch.zeros(d), torch.Generator().manual_seed(0),
                                                 1)
    # std of d normal draws: relative s.e. 1/sqrt(2(d-1)) = 1.6e-3; allow 4 s.e.
    # (measured 1.9e-4 with this seed)
    assert float(out.std()) == pytest.approx(sigma * c, rel=4 / math.sqrt(2 * (d - 1)))
    # clip bound: the output is the clipped input plus the same noise (same generator
    # state), bit for bit, and the clipped input has norm C up to the clip's own float32
    # norm of 1e5 terms (measured 3.8e-5 relative, float64 norm of the output)
    x = torch.full((100_000,), 0.01)  # norm 3.16
    g = torch.Generator().manual_seed(3)
    state = g.get_state()
    out = GaussianMechanism(sigma, c).apply(x, g)
    noise = torch.randn(x.shape, generator=torch.Generator().set_state(state)) * (sigma * c)
    assert torch.equal(out, l2_clip(x, c) + noise)
    assert float(l2_clip(x, c).double().norm()) == pytest.approx(c, rel=2e-4)
    assert float(l2_clip(x, 10.0).norm()) == pytest.approx(float(x.norm()), rel=1e-7)
    # clip=False: the input is kept as it is (a sum already bounded)
    unclipped = GaussianMechanism(sigma, c, clip=False).apply(x, torch.Generator().set_state(state))
    assert torch.equal(unclipped, x + noise)


def test_a_generator_is_required():
    for mechanism in (GaussianMechanism(1.0, 1.0), LaplaceMechanism(1.0, 1.0)):
        with pytest.raises(TypeError):
            mechanism.release(torch.zeros(3), round_=1)  # no generator


def test_gaussian_event_epsilon_is_dp_accountings():
    # replace-one: the sum moves by 2C, i.e. GaussianDpEvent(sigma / 2), built by hand
    events = [GaussianMechanism(1.3, 1.0, relation="replace-one").event(r) for r in range(1, 6)]
    hand = [(dp_event.GaussianDpEvent(0.65), 5)]
    # RDP curves summed over 5 rounds vs a count-5 composition: float rounding (measured 0)
    assert history_epsilon(events, D, "rdp") == pytest.approx(_rdp(hand), rel=1e-14)
    assert history_epsilon(events, D, "pld") == _pld(hand)  # same composition: bit-identical
    # Poisson-sampled (add-remove)
    sampled = [GaussianMechanism(1.1, 1.0, sample_rate=0.1).event(r) for r in (1, 2, 3)]
    hand = [(dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(1.1)), 3)]
    assert history_epsilon(sampled, D, "rdp") == pytest.approx(_rdp(hand), rel=1e-14)
    assert history_epsilon(sampled, D, "pld") == _pld(hand)
    with pytest.raises(ValueError, match="add-remove"):
        GaussianMechanism(1.1, 1.0, sample_rate=0.1, relation="replace-one").event(1).to_dp_event()


def test_dpsgd_release_event_is_opacus_and_dp_accountings():
    release = DpsgdRelease(noise_multiplier=1.1, sample_rate=0.02, steps=50)
    events = [release.event(r) for r in (1, 2)]
    opacus = RDPAccountant()
    opacus.history = [(1.1, 0.02, 50), (1.1, 0.02, 50)]
    # Opacus' compute_rdp on 100 steps vs two curves of 50: float rounding (measured 0)
    assert history_epsilon(events, D, "rdp") == pytest.approx(opacus.get_epsilon(D), rel=1e-14)
    hand = [(dp_event.PoissonSampledDpEvent(0.02, dp_event.GaussianDpEvent(1.1)), 100)]
    assert history_epsilon(events, D, "pld") == _pld(hand)


def test_laplace_scale_and_event():
    mech = LaplaceMechanism(epsilon=0.5, l1_sensitivity=2.0)
    assert mech.scale == 4.0
    n = 200_000
    out, event = mech.release(torch.zeros(n), torch.Generator().manual_seed(2), 3)
    # E|Lap(b)| = b and sd|Lap(b)| = b: relative s.e. 1/sqrt(n) = 2.2e-3; allow 4 s.e.
    # (measured 1.7e-3 with this seed)
    assert float(out.abs().mean()) == pytest.approx(4.0, rel=4 / math.sqrt(n))
    # Var Lap(b) = 2 b^2: the sample variance's relative s.e. is sqrt((kurtosis 6 + 2) / n)
    # = 6.3e-3; allow 4 s.e. (measured 4.6e-3)
    assert float(out.double().var()) == pytest.approx(32.0, rel=4 * math.sqrt(8 / n))
    assert torch.isfinite(out).all()
    assert event == PrivacyEvent.pure(3, 0.5, "laplace")
    # PLD: dp-accounting's Laplace event with scale 1 / eps (sensitivity 1), bit-identical
    assert history_epsilon([event], D, "pld") == _pld([(dp_event.LaplaceDpEvent(2.0), 1)])
    # RDP: the better of dp-accounting's Laplace RDP and the pure epsilon itself
    assert history_epsilon([event], D, "rdp") == min(_rdp([(dp_event.LaplaceDpEvent(2.0), 1)]),
                                                     0.5)


def test_sparse_vector_releases_at_most_c_answers():
    svt = SparseVector(eps_threshold=1.0, eps_queries=1.0, eps_answers=8.0, sensitivity=0.01,
                       threshold=50.0, max_answers=3)
    # four clear positives (margins of 50 against noise scales 0.01-0.06): the first three
    x = torch.zeros(1000)
    x[[10, 20, 30, 40]] = 100.0
    out, event = svt.release(x, torch.Generator().manual_seed(1), 2)
    assert set(torch.nonzero(out).flatten().tolist()) == {10, 20, 30}
    # the answers carry Lap(c Delta / eps3) = Lap(0.00375) noise: |noise| < 0.1 except with
    # probability 3 e^(-0.1 / 0.00375) ~ 1e-11
    assert torch.all((out[[10, 20, 30]] - 100.0).abs() < 0.1)
    assert event == PrivacyEvent.pure(2, 10.0, "sparse-vector")
    # noisy inputs near the threshold: never more than c answers
    g = torch.Generator().manual_seed(5)
    loose = SparseVector(0.1, 0.1, 0.1, sensitivity=1.0, threshold=0.0, max_answers=4)
    for _ in range(50):
        released, _ = loose.release(torch.randn(300, generator=g), g, 1)
        assert int(torch.count_nonzero(released)) <= 4
    with pytest.raises(ValueError):
        SparseVector(1.0, 1.0, 1.0, 1.0, 0.0, max_answers=0)


def test_quantile_tracker_update_event_and_noise_split():
    t = QuantileClipTracker(clip=1.0, target_quantile=0.5, learning_rate=0.2,
                            count_noise_multiplier=1e-9)
    new, event = t.release(torch.tensor([0.1, 0.2, 0.3, 5.0]), torch.Generator().manual_seed(0), 2)
    # 3 of 4 under C: b = 0.75 (+ 1e-9 N / 4), C <- exp(-0.2 (b - 0.5)); the noise moves C
    # by 5e-11 |N| relative, under 2e-10 for |N| < 4 (measured 7.7e-11)
    assert new == pytest.approx(math.exp(-0.2 * 0.25), rel=2e-10) and t.history == [1.0]
    # the count is centred (b_i - 1/2, sensitivity 1/2): multiplier 2 sigma_b
    assert event == PrivacyEvent.gaussian(2, 2e-9, mechanism="quantile-count")
    # a public denominator m = 8 with 4 replies: b = (3 - 2) / 8 + 1/2 = 0.625
    t = QuantileClipTracker(clip=1.0, count_noise_multiplier=1e-9)
    new, _ = t.release(torch.tensor([0.1, 0.2, 0.3, 5.0]), torch.Generator().manual_seed(0), 1,
                       expected_clients=8)
    assert new == pytest.approx(math.exp(-0.2 * 0.125), rel=2e-10)
    # the noise on the count: b's std is sigma_b / m (here 10 / 20 = 0.5), read back from C
    g = torch.Generator().manual_seed(4)
    fractions = []
    for _ in range(4000):
        t = QuantileClipTracker(clip=1.0, count_noise_multiplier=10.0)
        c, _ = t.release(torch.zeros(20), g, 1)
        fractions.append(0.5 - math.log(c) / 0.2)
    f = torch.tensor(fractions, dtype=torch.float64)
    # all 20 under C: mean b = 1; s.e. of the mean 0.5 / sqrt(4000) = 7.9e-3, of the std
    # 0.5 / sqrt(2 x 3999) = 5.6e-3; allow 4 s.e. (measured 8.9e-4 and 4.4e-3)
    assert float(f.mean()) == pytest.approx(1.0, abs=4 * 0.5 / math.sqrt(4000))
    assert float(f.std()) == pytest.approx(0.5, abs=4 * 0.5 / math.sqrt(2 * 3999))
    # Andrew et al.'s split: the update at sigma_Delta and the count at 2 sigma_b compose to
    # one Gaussian at z (RDP adds 1 / sigma^2 at every order): float rounding (measured
    # 2.2e-16)
    z, sb = 1.0, 10.0
    s_delta = QuantileClipTracker.update_noise_multiplier(z, sb)
    assert s_delta ** -2 + (2 * sb) ** -2 == pytest.approx(z ** -2, rel=1e-15)
    pair = [PrivacyEvent.gaussian(1, s_delta),
            QuantileClipTracker(1.0, count_noise_multiplier=sb).event(1)]
    assert history_epsilon(pair, D, "rdp") == pytest.approx(
        _rdp([(dp_event.GaussianDpEvent(z), 1)]), rel=1e-12)
    with pytest.raises(ValueError):
        QuantileClipTracker.update_noise_multiplier(1.0, 0.4)


def test_a_diverged_update_is_released_as_noise_around_zero():
    """NaN/inf from local training become the zero vector before clipping: the output is
    finite, its noise has the planned scale, and the event is the planned one."""
    x = torch.full((50_000,), float("nan"))
    x[:10] = float("inf")
    out, event = GaussianMechanism(0.8, 1.5, relation="replace-one").release(
        x, torch.Generator().manual_seed(3), 2)
    assert bool(torch.isfinite(out).all())
    assert float(out.std()) == pytest.approx(1.2, rel=0.02)
    assert float(out.mean()) == pytest.approx(0.0, abs=0.03)
    assert event == PrivacyEvent.gaussian(2, 0.8, relation="replace-one")
