"""Layout presets: recipes for engine conventions and model shapes for benchmarks."""
