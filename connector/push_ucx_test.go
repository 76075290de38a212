//go:build ucx && cgo

package connector_test

import (
	"testing"

	"github.com/kvbridge/kvbridge/transfer"
)

// TestPushOverUCX: push with UCX forced on both engines (UCX's put, over its TCP and
// shared-memory transports): P's WRITE lands in D's registered blocks and D answers as a
// single engine, serially and with both legs at once; both pools end full.
func TestPushOverUCX(t *testing.T) {
	for _, tls := range []string{"tcp", "sm"} {
		t.Run(tls, func(t *testing.T) {
			tc := transfer.Config{UCX: map[string]string{"TLS": tls}}
			p := startNode(t, "P", nodeOptions{kvConfig: pushCfg("kv_producer", "UCX"), transfer: tc})
			d := startNode(t, "D", nodeOptions{kvConfig: pushCfg("kv_consumer", "UCX"), transfer: tc})
			for i, run := range []func(*testing.T, *node, *node, []int, int) result{pushSerial, pushConcurrent} {
				prompt := tokens(50+i*20, 60+i)
				if r, want := run(t, p, d, prompt, 5), singleOutput(t, prompt, 5); r.Text != want {
					t.Errorf("flow %d: D answered %q, a single engine %q", i, r.Text, want)
				}
			}
			if st := p.conn.Agent().Stats(); st.BytesWritten == 0 {
				t.Errorf("P wrote nothing over UCX: %+v", st)
			}
			p.waitPoolFull(t)
			d.waitPoolFull(t)
		})
	}
}
