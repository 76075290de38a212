package routebench

import (
	"testing"

	"github.com/kvbridge/kvbridge/proxy"
)

// TestRunTiny runs the bench at a tiny size, as CI's smoke test: every policy serves every
// request with the same answers, and kv-aware routing finds cached prefixes.
func TestRunTiny(t *testing.T) {
	rows, err := Run(t.Context(), Options{Prefillers: 3, PrefillBlocks: 24, Systems: 2, SystemLen: 48, Users: 6, Turns: 2, UserLen: 8, Concurrency: 2, MaxTokens: 2})
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 3 {
		t.Fatalf("%d rows, want one per policy", len(rows))
	}
	for _, r := range rows {
		t.Logf("%+v", r)
		if r.Requests != 12 || r.Differing != 0 {
			t.Errorf("%s: %d requests (want 12), %d answers differ from %s's", r.Policy, r.Requests, r.Differing, rows[0].Policy)
		}
		if r.OracleHitRate <= 0 {
			t.Errorf("%s: the oracle found nothing cached in a shared-prefix workload", r.Policy)
		}
	}
	if kv := rows[2]; kv.Policy != proxy.KVAware || kv.HitRate <= 0 {
		t.Errorf("kv-aware row %+v: no prefix-cache hits", kv)
	}
}
