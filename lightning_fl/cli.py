"""``lightning-fl``: LightningCLI with fit, validate and test, reading YAML recipes.

lightning-fl fit --config recipes/quickstart.yaml
"""

from __future__ import annotations

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI


class FederatedCLI(LightningCLI):
    """LightningCLI whose ``fit`` also tests the final global model when asked to."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument(
            "--test_after_fit", type=bool, default=True, help="Run trainer.test after fit."
        )

    def after_fit(self) -> None:
        if self.config[self.subcommand].get("test_after_fit", True):
            self.trainer.test(self.model, datamodule=self.datamodule)


def run(args: list[str] | None = None) -> FederatedCLI:
    """Parse ``args`` (default: the command line), run the subcommand, return the CLI."""
    return FederatedCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        auto_configure_optimizers=False,
    )


def main() -> None:
    """The ``lightning-fl`` console script."""
    run()


if __name__ == "__main__":
    main()
