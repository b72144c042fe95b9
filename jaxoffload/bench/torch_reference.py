"""PyTorch peer of ``jaxoffload bench``: torchvision models, each memory mode in a fresh process.

The same training step as :func:`jaxoffload.bench.step.train_step`, written the
way a PyTorch user would: torchvision VGG19 or ResNet-50, ``channels_last``,
bf16 autocast, softmax cross-entropy, SGD with momentum 0.9. Modes:

- ``plain``: autograd keeps its saved tensors on the device;
- ``checkpoint``: ``torch.utils.checkpoint`` on every block, the peer of
  ``nn.remat`` per block (VGG: conv+ReLU, with the pool that follows; ResNet:
  the stem and each bottleneck);
- ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, the
  peer of offloading every residual.

It writes JSON records with the fields of ``jaxoffload bench``'s records.
PyTorch compiles nothing ahead of time, so the ``compiled_*`` fields are null.

Usage (on a CUDA machine)::

    python -m jaxoffload.bench.torch_reference --model vgg19 --batch 128 \
        --out torch_vgg19_b128.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ("plain", "checkpoint", "save_on_cpu")
MODELS = ("vgg19", "resnet50")


def _blocks(model, name: str):
    """The model's forward as a list of blocks, for per-block checkpointing."""
    import torch

    if name.startswith("vgg"):
        blocks, current = [], []
        for layer in model.features:
            # A block starts at each conv; ReLU and a following pool join it.
            if isinstance(layer, torch.nn.Conv2d) and current:
                blocks.append(torch.nn.Sequential(*current))
                current = []
            current.append(layer)
        blocks.append(torch.nn.Sequential(*current))
        head = [model.avgpool, torch.nn.Flatten(1), model.classifier]
    else:
        blocks = [torch.nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)]
        for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
            blocks.extend(stage)
        head = [model.avgpool, torch.nn.Flatten(1), model.fc]
    return blocks, torch.nn.Sequential(*head)


def measure(
    model_name: str,
    mode: str,
    batch: int,
    image_size: int,
    steps: int,
    warmup: int,
    reference: str | None,
) -> dict:
    """One mode's record, measured in this process."""
    import torch
    import torchvision

    torch.manual_seed(0)
    device = torch.device("cuda")
    model = getattr(torchvision.models, model_name)(num_classes=1000)
    model = model.to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(batch, 3, image_size, image_size, device=device)
    x = x.to(memory_format=torch.channels_last)
    labels = torch.randint(0, 1000, (batch,), device=device)
    initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    backward = _backward(model, model_name, mode, x, labels)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = backward()
        opt.step()
        return loss

    loss, times = _time_steps(step, warmup=warmup, steps=steps)
    # Like jax's peak_bytes_in_use, the peak covers the whole process.
    peak = torch.cuda.max_memory_allocated()
    final_loss = float(loss)
    grad_rel_err = None
    if reference is not None:
        grad_rel_err = _gradient_error(model, opt, backward, initial, reference)
    step_s = statistics.median(times)
    return {
        "model": model_name,
        "batch": batch,
        "image_size": image_size,
        "dtype": "bfloat16",
        "strategy": mode,
        "framework": "torch",
        "device": torch.cuda.get_device_name(),
        "platform": "gpu",
        "torch_version": torch.__version__,
        "torchvision_version": torchvision.__version__,
        "compiled_temp_bytes": None,
        "compiled_host_temp_bytes": None,
        "peak_bytes_in_use": peak,
        "step_time_ms": step_s * 1e3,
        "step_times_ms": [t * 1e3 for t in times],
        "images_per_s": batch / step_s,
        "final_loss": final_loss,
        "grad_rel_err": grad_rel_err,
        "date": datetime.date.today().isoformat(),
    }


def _backward(model, model_name: str, mode: str, x, labels):
    """``backward()``: the loss of ``x`` under ``mode``, its gradients accumulated; returns the loss."""
    import torch
    from torch.utils.checkpoint import checkpoint

    blocks, head = _blocks(model, model_name)

    def loss_fn():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = x
            for block in blocks:
                if mode == "checkpoint":
                    h = checkpoint(block, h, use_reentrant=False)
                else:
                    h = block(h)
            logits = head(h)
        return torch.nn.functional.cross_entropy(logits.float(), labels)

    def backward():
        if mode == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                loss = loss_fn()
        else:
            loss = loss_fn()
        loss.backward()
        return loss

    return backward


def _time_steps(step, *, warmup: int, steps: int):
    """``(loss, times)``: ``warmup`` untimed steps, then ``steps`` each timed to its end, in seconds."""
    import torch

    for _ in range(warmup):
        loss = step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return loss, times


def _gradient_error(model, opt, backward, initial, reference: str) -> float:
    """The gradient at the initial parameters, against the one stored at ``reference``."""
    # The same comparison as jaxoffload bench's (importing jax starts no device client).
    from jaxoffload.bench.gradients import gradient_error

    model.load_state_dict(initial)
    opt.zero_grad(set_to_none=True)
    backward()
    grads = [p.grad.double().cpu().numpy() for p in model.parameters()]
    return gradient_error(grads, reference)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vgg19", choices=MODELS)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {MODES}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", required=True, help="JSON file for the records")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: one mode, JSON on stdout
    parser.add_argument("--reference", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        record = measure(
            args.model,
            args.child,
            args.batch,
            args.image_size,
            args.steps,
            args.warmup,
            args.reference,
        )
        print(json.dumps(record), flush=True)
        return
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        parser.error(f"unknown modes {bad or modes}; choose from {','.join(MODES)}")
    # 'plain' runs first: its gradient is the reference for the others.
    modes.sort(key=lambda m: m != "plain")
    command = shlex.join([os.path.relpath(__file__), *(argv if argv is not None else sys.argv[1:])])
    records = []
    with tempfile.TemporaryDirectory() as folder:
        reference = os.path.join(folder, "reference.npz") if modes[0] == "plain" else None
        for mode in modes:
            records.append(_run_mode(args, mode, reference, command))
    with open(args.out, "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")


def _run_mode(args: argparse.Namespace, mode: str, reference: str | None, command: str) -> dict:
    """One mode's record, measured in a fresh process; exits if that process fails but for memory."""
    print(f"{args.model} b{args.batch}: {mode} ...", file=sys.stderr, flush=True)
    child = [
        sys.executable,
        __file__,
        "--model",
        args.model,
        "--batch",
        str(args.batch),
        "--image-size",
        str(args.image_size),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--out",
        args.out,
        "--child",
        mode,
    ]
    if reference:
        child += ["--reference", reference]
    done = subprocess.run(child, capture_output=True, text=True)
    if done.returncode != 0:
        if "CUDA out of memory" in done.stderr or "OutOfMemoryError" in done.stderr:
            return {
                "model": args.model,
                "batch": args.batch,
                "strategy": mode,
                "framework": "torch",
                "out_of_memory": True,
            }
        sys.exit(f"{mode} failed:\n{done.stderr[-3000:]}")
    record = json.loads(done.stdout.strip().splitlines()[-1])
    record["command"] = command
    print(
        f"  peak {record['peak_bytes_in_use'] / 2**30:.2f} GiB, "
        f"step {record['step_time_ms']:.1f} ms, grad err {record['grad_rel_err']}",
        file=sys.stderr,
        flush=True,
    )
    return record


if __name__ == "__main__":
    main()
