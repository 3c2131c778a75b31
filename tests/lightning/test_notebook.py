"""The notebook names for real: examples/notebook.ipynb runs in a Jupyter kernel.

The notebook trains on 2 CPU processes forked from the kernel, with the Trainer and with
Fabric under ``strategy="bucket_ddp_notebook"``. The cells appended here run in the same
kernel: they check both against one process on the global batch, then run the
``bucket_ddp_fork`` names, which fork the same way, against the same ground truth.
"""

from __future__ import annotations

import textwrap

import pytest

from lightning_runs import ROOT

pytest.importorskip("lightning")
nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

CHECKS = [
    # Fabric's loop reads the data in order: one process on the global batch (the two
    # processes' batches of 8 side by side) is the ground truth. The Trainer shuffles its
    # training data, with a sampler of its own choosing: Lightning's "ddp_notebook" on the
    # same seed is its ground truth.
    """
    def one_process() -> dict[str, torch.Tensor]:
        net = network()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        for x, y in DataLoader(dataset, batch_size=16):
            F.mse_loss(net(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        return net.state_dict()


    def trained(strategy: str) -> tuple[Trainer, dict[str, torch.Tensor]]:
        model = Regression()
        trainer = Trainer(
            strategy=strategy, accelerator="cpu", devices=2, max_epochs=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        )
        trainer.fit(model)
        return trainer, model.net.state_dict()


    def same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
        assert got.keys() == want.keys()
        for name in want:
            assert torch.allclose(got[name], want[name], atol=1e-6), name


    initial = network().state_dict()
    truth = one_process()
    assert not torch.equal(truth["0.weight"], initial["0.weight"])
    same(fabric_weights, truth)
    _, ddp_weights = trained("ddp_notebook")
    assert not torch.equal(ddp_weights["0.weight"], initial["0.weight"])
    same(trainer_weights, ddp_weights)
    assert type(trainer.strategy).__name__ == "BucketDDP"
    assert type(fabric.strategy).__name__ == "BucketFabricDDP"
    assert trainer.strategy._start_method == fabric.strategy._start_method == "fork"
    """,
    # The fork names fork from the kernel in the same way.
    """
    trainer, weights = trained("bucket_ddp_fork_find_unused_parameters_true")
    assert type(trainer.strategy).__name__ == "BucketDDP"
    assert trainer.strategy._ddp_kwargs["find_unused_parameters"] is True
    same(weights, ddp_weights)

    fabric = Fabric(strategy="bucket_ddp_fork", accelerator="cpu", devices=2)
    assert fabric.launch(train) == 4
    assert type(fabric.strategy).__name__ == "BucketFabricDDP"
    same(torch.load(checkpoint)["model"], truth)
    print("checks passed")
    """,
]


@pytest.mark.compat("notebook")
def test_notebook_trains_in_a_kernel_as_one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel and the ranks it forks
    notebook = nbformat.read(ROOT / "examples" / "notebook.ipynb", as_version=4)
    for source in CHECKS:
        notebook.cells.append(nbformat.v4.new_code_cell(textwrap.dedent(source).strip()))
    client = nbclient.NotebookClient(
        notebook, timeout=240, kernel_name="python3", resources={"metadata": {"path": ROOT}}
    )
    client.execute()
    printed = "".join(out.get("text", "") for out in notebook.cells[-1].outputs)
    assert "checks passed" in printed
