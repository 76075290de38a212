package instance_test

import (
	"bytes"
	"encoding/json"
	"net/http"
	"sync"
	"testing"

	"github.com/kvbridge/kvbridge/connector"
	"github.com/kvbridge/kvbridge/instance"
	"github.com/kvbridge/kvbridge/model"
)

// postJSON posts body to url and decodes the JSON answer.
func postJSON(t *testing.T, url string, body any) (int, map[string]any) {
	t.Helper()
	data, _ := json.Marshal(body)
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, url, bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, out
}

func completionText(t *testing.T, m map[string]any) string {
	t.Helper()
	choices, _ := m["choices"].([]any)
	if len(choices) != 1 {
		t.Fatalf("answer without one choice: %v", m)
	}
	s, _ := choices[0].(map[string]any)["text"].(string)
	return s
}

// TestPushBothLegsAtOnceWithDataParallelP: a push prefiller with two data-parallel ranks reports
// rank 0's coordinates at GET /v1/kv_transfer; a prefill leg carrying a push_id goes to rank 0
// (where the least-loaded turn would alternate ranks), so the decoder's registration, sent there
// at the same time, finds it. Every answer equals a single engine's and every pool is full at
// the end.
func TestPushBothLegsAtOnceWithDataParallelP(t *testing.T) {
	m, err := model.Open(t.Context(), model.Tiny, model.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	start := func(kv *connector.Config, dp int) *instance.Instance {
		in, err := instance.Start(t.Context(), instance.Config{OpenedModel: m, Host: "127.0.0.1", NumBlocks: 64, MaxModelLen: 512,
			KVTransfer: kv, SideChannelPort: -1, DataParallelSize: dp})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			in.Close()
			for _, rk := range in.Ranks {
				if free, n := rk.Pool.NumFree(), rk.Pool.NumBlocks(); free != n {
					t.Errorf("rank %d: %d of %d blocks free after Close", rk.Index, free, n)
				}
			}
		})
		return in
	}
	pcfg, dcfg := connector.DefaultConfig(connector.RoleProducer), connector.DefaultConfig(connector.RoleConsumer)
	pcfg.Connector, dcfg.Connector = connector.ConnectorPush, connector.ConnectorPush
	p, d, single := start(pcfg, 2), start(dcfg, 1), start(nil, 1)
	resp, err := http.Get(p.URL + "/v1/kv_transfer")
	if err != nil {
		t.Fatal(err)
	}
	var info connector.Info
	err = json.NewDecoder(resp.Body).Decode(&info)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	if info.EngineID != p.Ranks[0].Connector.EngineID() || info.TransferMode != "push" || info.RemotePort == 0 {
		t.Fatalf("P reports %+v", info)
	}
	for i := range 4 {
		prompt := make([]int, 40+i*9)
		for j := range prompt {
			prompt[j] = 300 + (i*131+j*17)%2000
		}
		body := map[string]any{"model": model.Tiny, "prompt": prompt, "max_tokens": 5, "temperature": 0}
		_, ref := postJSON(t, single.URL+"/v1/completions", body)
		id := "push-" + string(rune('a'+i))
		pleg := map[string]any{"model": model.Tiny, "prompt": prompt, "max_tokens": 1,
			"kv_transfer_params": map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "push_id": id}}
		dleg := map[string]any{"model": model.Tiny, "prompt": prompt, "max_tokens": 5, "temperature": 0,
			"kv_transfer_params": map[string]any{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": info.EngineID,
				"remote_host": info.RemoteHost, "remote_port": info.RemotePort, "tp_size": info.TPSize, "push_id": id}}
		var wg sync.WaitGroup
		var pstatus int
		wg.Go(func() { pstatus, _ = postJSON(t, p.URL+"/v1/completions", pleg) })
		status, got := postJSON(t, d.URL+"/v1/completions", dleg)
		wg.Wait()
		if pstatus != 200 || status != 200 {
			t.Fatalf("request %d: prefill %d, decode %d: %v", i, pstatus, status, got)
		}
		if a, b := completionText(t, got), completionText(t, ref); a != b {
			t.Errorf("request %d: D answered %q, a single engine %q", i, a, b)
		}
	}
	if n := d.Ranks[0].Engine.Stats().ExternalHits; n == 0 {
		t.Error("D loaded nothing pushed")
	}
}
