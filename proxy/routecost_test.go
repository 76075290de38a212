package proxy

import "testing"

// TestPrefillCost: the choices the kv-aware cost must make, derived by hand from its purpose.
func TestPrefillCost(t *testing.T) {
	const n = 32
	cases := []struct {
		name                  string
		winner, loser         float64 // costs
		winnerName, loserName string
	}{
		{"a full hit beats a miss even on an engine that had all the work so far",
			prefillCost(n, n, 2, 0), prefillCost(n, 0, 0, 0), "holder", "idle engine"},
		{"a near-full hit (a new turn) beats a miss on the engine that had none of the work",
			prefillCost(n, n-2, 2, 0), prefillCost(n, 0, 0, 0), "holder", "idle engine"},
		{"a holder of most of a prompt keeps it though it had all of the work so far (3 engines)",
			prefillCost(n, 20, 3, 0), prefillCost(n, 0, 0, 0), "holder", "idle engine"},
		{"a prompt nobody holds goes to the engine that had less work",
			prefillCost(n, 0, 0.5, 0), prefillCost(n, 0, 1.5, 0), "less-worked engine", "more-worked engine"},
		{"a hot prefix spreads once its holder runs three more requests",
			prefillCost(n, 0, 1, 0), prefillCost(n, n, 1, 3), "idle engine", "busy holder"},
		{"but not while it runs only one more",
			prefillCost(n, n, 1, 1), prefillCost(n, 0, 1, 0), "holder", "idle engine"},
	}
	for _, c := range cases {
		if !(c.winner < c.loser) {
			t.Errorf("%s: the %s costs %.1f, the %s %.1f", c.name, c.winnerName, c.winner, c.loserName, c.loser)
		}
	}
}
