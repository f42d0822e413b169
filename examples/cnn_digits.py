"""A small CNN on 8x8 digit images, NHWC on the device, checked against numpy.

conv2d (8 filters 3x3, padding 1) -> relu -> max_pool2d 2 -> flatten -> linear -> argmax, on a
batch of [N, 8, 8, 1] images. The images are drawn here: a hand-made 8x8 bitmap per digit,
shifted by a pixel and sprinkled with noise (no data set to download). The convolution's
weights are seeded random features; the linear layer is fitted to them on the host in closed
form (ridge regression on one-hot labels), so the predictions mean something.

The device's logits equal a numpy reference with its own convolution (loops over the 3x3
taps) and pooling, within float32 rounding, and its predictions are the same.
"""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np

import ttflow as tt

F32 = tt.DataType.FLOAT32
TILE = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, F32)
FILTERS, CLASSES = 8, 10

GLYPHS = [  # 0-9, 8x8
    ["..####..", ".#....#.", ".#....#.", ".#....#.", ".#....#.", ".#....#.", ".#....#.", "..####.."],
    ["...##...", "..###...", "...##...", "...##...", "...##...", "...##...", "...##...", "..####.."],
    ["..####..", ".#....#.", "......#.", ".....#..", "....#...", "...#....", "..#.....", ".######."],
    ["..####..", ".#....#.", "......#.", "...###..", "......#.", "......#.", ".#....#.", "..####.."],
    [".....#..", "....##..", "...#.#..", "..#..#..", ".######.", ".....#..", ".....#..", ".....#.."],
    [".######.", ".#......", ".#......", ".#####..", "......#.", "......#.", ".#....#.", "..####.."],
    ["..####..", ".#......", ".#......", ".#####..", ".#....#.", ".#....#.", ".#....#.", "..####.."],
    [".######.", "......#.", ".....#..", "....#...", "...#....", "...#....", "...#....", "...#...."],
    ["..####..", ".#....#.", ".#....#.", "..####..", ".#....#.", ".#....#.", ".#....#.", "..####.."],
    ["..####..", ".#....#.", ".#....#.", ".#....#.", "..#####.", "......#.", "......#.", "..####.."],
]


def digits(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n noisy digit images [n, 8, 8, 1] in [0, 1] and their labels."""
    glyphs = np.array([[[c == "#" for c in row] for row in g] for g in GLYPHS], np.float32)
    labels = rng.integers(0, CLASSES, n)
    images = np.empty((n, 8, 8), np.float32)
    for i, label in enumerate(labels):
        dy, dx = rng.integers(-1, 2, 2)
        images[i] = np.roll(glyphs[label], (dy, dx), axis=(0, 1))
    images = np.clip(images * rng.uniform(0.6, 1.0, (n, 1, 1)) + rng.normal(0, 0.2, images.shape), 0, 1)
    return images[..., None].astype(np.float32), labels


def build(batch: int) -> tt.Binary:
    b = tt.ProgramBuilder("cnn")
    x = b.input((batch, 8, 8, 1), TILE)
    conv_w, conv_b = b.input((FILTERS, 1, 3, 3), TILE), b.input((FILTERS,), TILE)
    fc_w, fc_b = b.input((4 * 4 * FILTERS, CLASSES), TILE), b.input((CLASSES,), TILE)
    h = b.max_pool2d(b.relu(b.conv2d(x, conv_w, conv_b, padding=1)), 2)  # [N, 4, 4, 8]
    logits = b.add(b.matmul(b.reshape(h, (batch, 4 * 4 * FILTERS)), fc_w), fc_b)
    b.output(logits)
    b.output(b.argmax(logits, -1))
    return tt.Binary([b.build()])


def features(images: np.ndarray, conv_w: np.ndarray, conv_b: np.ndarray) -> np.ndarray:
    """numpy: conv (3x3, padding 1, tap by tap) -> relu -> 2x2 max pool -> flatten (NHWC order)."""
    n = len(images)
    padded = np.pad(images[..., 0], ((0, 0), (1, 1), (1, 1)))
    conv = np.zeros((n, 8, 8, FILTERS), np.float32) + conv_b
    for dy in range(3):
        for dx in range(3):
            conv += padded[:, dy : dy + 8, dx : dx + 8, None] * conv_w[:, 0, dy, dx]
    pooled = np.maximum(conv, 0).reshape(n, 4, 2, 4, 2, FILTERS).max(axis=(2, 4))
    return pooled.reshape(n, -1)


def fit_head(feats: np.ndarray, labels: np.ndarray, ridge: float = 1e-1) -> tuple[np.ndarray, np.ndarray]:
    """A linear layer fitted in closed form: ridge regression onto one-hot labels."""
    x = np.hstack([feats, np.ones((len(feats), 1), np.float32)]).astype(np.float64)
    y = np.eye(CLASSES)[labels]
    w = np.linalg.solve(x.T @ x + ridge * np.eye(x.shape[1]), x.T @ y)
    return w[:-1].astype(np.float32), w[-1].astype(np.float32)


async def main(batch: int = 64, train: int = 500, spec: tt.DeviceSpec | None = None) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    conv_w = rng.normal(0, 0.5, (FILTERS, 1, 3, 3)).astype(np.float32)
    conv_b = rng.normal(0, 0.1, FILTERS).astype(np.float32)
    train_x, train_y = digits(train, rng)
    fc_w, fc_b = fit_head(features(train_x, conv_w, conv_b), train_y)
    images, labels = digits(batch, rng)
    async with tt.open_device(spec) as device:
        params = [tt.to_device(a, device, TILE) for a in (conv_w, conv_b, fc_w, fc_b)]
        logits, predicted = tt.submit(device, build(batch), 0, [tt.to_device(images, device, TILE), *params])
        got_logits, got = await tt.to_host(logits), (await tt.to_host(predicted))[:, 0]
    ref_logits = features(images, conv_w, conv_b) @ fc_w + fc_b
    err = float(np.abs(got_logits - ref_logits).max())
    same = bool((got == ref_logits.argmax(-1)).all())
    accuracy = float((got == labels).mean())
    print(f"{batch} digits, NHWC [{batch}, 8, 8, 1]: conv2d 3x3 -> relu -> max_pool2d 2 -> linear")
    print(f"  max |logit - numpy| {err:.2e}; predictions equal numpy's: {same}; accuracy {accuracy:.0%}")
    return {"max_error": err, "same_predictions": same, "accuracy": accuracy}


if __name__ == "__main__":
    anyio.run(main)
