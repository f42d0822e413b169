"""Training on the device: softmax regression by SGD, weights updated in place on the device.

Each step is one program that computes the loss, the gradient and the updated weights; the
updated weights feed the next step. Only the losses we ask for and the final weights come back.
"""

from __future__ import annotations

import anyio
import numpy as np

import ttflow as tt

TILE = tt.Layout(tt.MemorySpace.DRAM, tt.TensorLayout.TILE, tt.DataType.FLOAT32)


def build(n: int, d: int, k: int, lr: float) -> tt.Binary:
    b = tt.ProgramBuilder("sgd_step")
    w = b.input((d, k), TILE)
    x = b.input((n, d), TILE)
    y = b.input((n, k), TILE)  # one-hot labels
    p = b.softmax(b.matmul(x, w))
    grad = b.mul(b.matmul(b.transpose(x), b.sub(p, y)), 1.0 / n)
    b.output(b.sub(w, b.mul(grad, lr)))
    # cross-entropy proxy: mean squared error of the probabilities (cheap, monotone here)
    err = b.sub(p, y)
    b.output(b.mul(b.sum(b.sum(b.mul(err, err), axis=1), axis=0), 1.0 / n))
    return tt.Binary([b.build()])


async def main(steps: int = 60, n: int = 256, d: int = 32, k: int = 4, lr: float = 0.5,
               spec: tt.DeviceSpec | None = None) -> dict[str, float]:
    rng = np.random.default_rng(2)
    centers = rng.standard_normal((k, d)).astype(np.float32) * 2
    labels = rng.integers(0, k, n)
    x = (centers[labels] + rng.standard_normal((n, d))).astype(np.float32)
    y = np.eye(k, dtype=np.float32)[labels]
    binary = build(n, d, k, lr)
    async with tt.open_device(spec) as device:
        tx, ty = tt.to_device(x, device, TILE), tt.to_device(y, device, TILE)
        tw = tt.to_device(np.zeros((d, k), np.float32), device, TILE)
        losses = []
        for _ in range(steps):
            tw, loss = tt.submit(device, binary, 0, [tw, tx, ty])
            losses.append(loss)
        first, last = [float((await tt.to_host(t))[0, 0]) for t in (losses[0], losses[-1])]
        w = await tt.to_host(tw)
        s = device.stats
    accuracy = float(((x @ w).argmax(-1) == labels).mean())
    print(f"softmax regression, {steps} SGD steps on the device")
    print(f"  loss {first:.4f} -> {last:.2e}; training accuracy {accuracy:.1%}")
    print(f"  host->device {s.host_to_device_bytes} bytes (data and initial weights, once); "
          f"device->host {s.device_to_host_bytes} bytes (two losses and the final weights)")
    return {"first_loss": first, "last_loss": last, "accuracy": accuracy,
            "d2h": s.device_to_host_bytes, "weights_bytes": w.nbytes}


if __name__ == "__main__":
    anyio.run(main)
