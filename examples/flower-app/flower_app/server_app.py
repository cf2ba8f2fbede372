"""flower-app: A Flower / PyTorch app."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedfuse.strategies import OneShotFusion
from flower_app.task import Net, load_centralized_test, load_fusion_set, test

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""

    # Read run config
    lr: float = context.run_config["lr"]

    # Load global model
    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())

    strategy = OneShotFusion(
        "kf-sites,fedavg", model_fn=Net, fusion_set=load_fusion_set(), client_statistics=True
    )

    # Start strategy: every site trains and uploads once, the server fuses the uploads
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": lr}),
        evaluate_fn=global_evaluate,
    )

    # Save final model to disk
    print("\nSaving final model to disk...")
    state_dict = result.arrays.to_torch_state_dict()
    torch.save(state_dict, context.run_config["save-path"])


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Evaluate model on central data."""
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    loss, accuracy = test(model, load_centralized_test(), device)
    return MetricRecord({"accuracy": accuracy, "loss": loss})
