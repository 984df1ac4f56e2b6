"""What-if simulation: traces, the FGD paper's placement method, and virtual-time replay through the scheduling core."""
