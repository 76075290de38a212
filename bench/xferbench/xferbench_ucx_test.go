//go:build ucx && cgo

package xferbench

import "testing"

// TestRunUCX runs a tiny matrix with UCX next to the backend it is compared with, over
// UCX_TLS=tcp (TCP) and shared memory (SHM): UCX rows carry their ratio to that backend's
// row of the same run and the ceiling of the transport UCX uses. It asserts no timing.
func TestRunUCX(t *testing.T) {
	for _, tc := range []struct{ tls, other, ceiling string }{{"tcp", "TCP", "tcp_stream"}, {"sm", "SHM", "memcpy"}} {
		t.Run(tc.tls, func(t *testing.T) {
			t.Setenv("UCX_TLS", tc.tls) // read by UCX in this process and the peer's
			rows, err := Run(t.Context(), Options{
				Backends:    []string{tc.other, "UCX"},
				Blocks:      []int64{64 << 10},
				Batches:     []int{1, 8},
				Iters:       3,
				Rounds:      2,
				Warmup:      1,
				Notify:      true,
				PeerCommand: testPeerCommand,
			})
			if err != nil {
				t.Fatal(err)
			}
			if len(rows) != 2*2*2 {
				t.Fatalf("%d rows", len(rows))
			}
			for _, r := range rows[len(rows)/2:] {
				vs := r.VsTCP
				if tc.other == "SHM" {
					vs = r.VsSHM
				}
				if r.Backend != "UCX" || r.GBps <= 0 || vs <= 0 || r.Ceiling != tc.ceiling {
					t.Fatalf("row %+v", r)
				}
			}
		})
	}
}
