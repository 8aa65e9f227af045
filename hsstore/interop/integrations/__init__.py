"""Train from an hsstore dataset with another project's trainer, without converting.

Each submodule imports its peer package when it is imported itself, so ``import hsstore`` never
needs them: ``hsstore.interop.integrations.speculators`` (speculators 0.9's dataset class) and
``hsstore.interop.integrations.specforge`` (SpecForge 0.2's offline feature store).
"""
