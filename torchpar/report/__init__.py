"""Reports: plan summaries, HTML/PNG, and the side-by-side loss comparison."""
