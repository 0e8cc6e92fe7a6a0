"""Randomness of the DP mechanisms: secret by default, public only on request.

Every draw a DP guarantee relies on (Gaussian noise of DP-SGD and of update-level DP, the
Poisson batch sampling of DP-SGD, and any later random mask or sparse-vector noise) must be
unpredictable to whoever sees the output. A generator seeded from the run-config seed, the
partition id and the round is not: all three are known to the server, which can regenerate
the noise and subtract it.

:func:`mechanism_generator` therefore returns, by default, a torch generator whose whole
state comes from the operating system's entropy (``os.urandom``): on the CPU the 624 32-bit
words of the Mersenne Twister state (19,968 bits), on CUDA the Philox seed and offset
(126 bits). Nothing of it is logged, stored in the checkpoint or sent in a message, and
``Generator.initial_seed()`` reports 0. Scope, stated in every guarantee: this is a PRNG with
a secret seed, not a cryptographically secure generator (Opacus' ``secure_mode`` needs
torchcsprng, which cannot be installed here), and floating-point attacks on the Gaussian
sampler (Mironov 2012, "On significance of the least significant bits for differential
privacy") are not addressed.

``reproducible=true`` seeds the same generators from public values instead, so that a rerun
is bit-identical; its verdict is ``none: DP noise seeded from public values (reproducible
mode)``. Model initialisation, data partitioning, local shuffling of non-DP training and
evaluation stay seeded from the run-config in both modes: they are not part of a mechanism.
"""

from __future__ import annotations

import os
import struct

import torch

# Layout of torch's CPU generator state (ATen CPUGeneratorImplState): uint64 initial seed,
# int32 left, int32 seeded, uint64 next, 624 x uint64 Mersenne Twister words, then the
# cached normal samples (40 bytes).
_MT_WORDS = 624
_MT_HEADER = struct.Struct("<QiiQ")
def scope(draws: str = "noise and Poisson sampling come") -> str:
    """The randomness part of a guarantee's scope; ``draws``: what the mechanism draws,
    with its verb (DP-SGD: "noise and Poisson sampling come"; update-level DP: "noise
    comes")."""
    return (f"{draws} from a PRNG (Mersenne "
            "Twister on CPU, Philox on CUDA) whose whole state is drawn from OS entropy per "
            "client and round, never logged or stored; not a CSPRNG (torchcsprng is "
            "unavailable), and floating-point attacks on the Gaussian sampler (Mironov 2012) "
            "are not addressed")


SCOPE = scope()
REPRODUCIBLE_VERDICT = "DP noise seeded from public values (reproducible mode)"


# Strides of the public seed: primes larger than any round count (1,009) and than any
# partition id x stride (100,003), so (seed, partition, round) triples of one run never
# share a seed.
SEED_STRIDE = 100_003
PARTITION_STRIDE = 1_009


def public_seed(seed: int, partition_id: int, server_round: int) -> int:
    """The public seed of ``reproducible`` mode (run-config seed, partition, round)."""
    return seed * SEED_STRIDE + partition_id * PARTITION_STRIDE + server_round


def _secret_cpu_state() -> torch.Tensor:
    template = bytearray(torch.Generator().get_state().numpy().tobytes())
    words = bytearray(_MT_WORDS * 8)
    entropy = os.urandom(_MT_WORDS * 4)
    for i in range(_MT_WORDS):  # each uint64 slot holds one 32-bit MT word
        words[8 * i:8 * i + 4] = entropy[4 * i:4 * i + 4]
    # left = 1 makes the next draw regenerate the whole state from these words
    header = _MT_HEADER.pack(0, 1, 1, 0)
    state = header + bytes(words) + bytes(len(template) - _MT_HEADER.size - len(words))
    return torch.frombuffer(bytearray(state), dtype=torch.uint8)


def secret_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator whose state is drawn from OS entropy (never from public values)."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    if device.type == "cpu":
        gen.set_state(_secret_cpu_state())
    else:  # CUDA Philox: 64-bit seed + offset (a multiple of 4, as graph-safe offsets are)
        seed = int.from_bytes(os.urandom(8), "little")
        offset = (int.from_bytes(os.urandom(8), "little") >> 2) << 2
        gen.set_state(torch.tensor(list(struct.pack("<QQ", seed, offset & (2 ** 63 - 1))),
                                   dtype=torch.uint8))
    return gen


def mechanism_generator(reproducible: bool, seed: int, partition_id: int, server_round: int,
                        device: torch.device | str = "cpu") -> torch.Generator:
    """The generator for one client's DP draws in one round: secret unless ``reproducible``."""
    if not reproducible:
        return secret_generator(device)
    return torch.Generator(device=device).manual_seed(public_seed(seed, partition_id,
                                                                  server_round))
