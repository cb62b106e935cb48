"""A stand-in random generator that replays given uniforms, for path tests."""


class ScriptedRng:
    """Stands in for np.random.Generator and hands out given uniforms in order."""

    def __init__(self, uniforms):
        self.uniforms = list(uniforms)
        self.n_used = 0

    def random(self) -> float:
        value = self.uniforms[self.n_used]
        self.n_used += 1
        return value
