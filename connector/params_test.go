package connector

import (
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
)

func decodeJSON(t testing.TB, s string) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		t.Fatal(err)
	}
	return m
}

func TestParseParamsSpecExample(t *testing.T) {
	p, err := ParseParams(decodeJSON(t, `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[12,13,14]],
		"remote_engine_id":"e1","remote_request_id":"cmpl-x-0","remote_host":"10.0.0.1","remote_port":5600,"tp_size":1,
		"dcp_size":1,"pp_size":1,"remote_num_tokens":37,"remote_blocks_expiry_time":null,"transfer_mode":"pull"}`))
	if err != nil {
		t.Fatal(err)
	}
	if !p.Complete() || !p.DoRemotePrefill || !reflect.DeepEqual(p.Blocks(), []int32{12, 13, 14}) || p.RemoteNumTokens != 37 || p.RemoteBlocksExpiryTime != nil {
		t.Errorf("parsed %+v", p)
	}
	back, err := ParseParams(decodeJSON(t, mustJSON(t, p.Map())))
	if err != nil || !reflect.DeepEqual(back, p) {
		t.Errorf("round trip = %+v, %v; want %+v", back, err, p)
	}
}

func TestParseParamsFlatBlockIDsAndTemplate(t *testing.T) {
	p, err := ParseParams(decodeJSON(t, `{"remote_block_ids":[1,2],"remote_engine_id":"e"}`))
	if err != nil || !reflect.DeepEqual(p.RemoteBlockIDs, [][]int32{{1, 2}}) || p.Complete() {
		t.Errorf("flat ids: %+v %v (incomplete params must not be Complete)", p, err)
	}
	// The proxy's first-turn template: four remote fields null.
	p, err = ParseParams(decodeJSON(t, `{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`))
	if err != nil || !p.DoRemoteDecode || p.Complete() {
		t.Errorf("template: %+v %v", p, err)
	}
}

func TestParseParamsWrongTypes(t *testing.T) {
	for doc, field := range map[string]string{
		`{"remote_block_ids":"1,2"}`:          "remote_block_ids",
		`{"remote_block_ids":[[1,"x"]]}`:      "remote_block_ids",
		`{"remote_block_ids":[[1],2]}`:        "remote_block_ids",
		`{"remote_block_ids":[-1]}`:           "remote_block_ids",
		`{"remote_port":"5600"}`:              "remote_port",
		`{"remote_port":70000}`:               "remote_port",
		`{"do_remote_decode":"yes"}`:          "do_remote_decode",
		`{"tp_size":1.5}`:                     "tp_size",
		`{"remote_engine_id":5}`:              "remote_engine_id",
		`{"kvbridge_block_generations":[-1]}`: KeyBlockGenerations,
		`{"kvbridge_block_hashes":[1]}`:       KeyBlockHashes,
	} {
		_, err := ParseParams(decodeJSON(t, doc))
		if !errors.Is(err, ErrParams) || !strings.Contains(err.Error(), field) {
			t.Errorf("ParseParams(%s) error = %v, want ErrParams naming %s", doc, err, field)
		}
	}
}

func mustJSON(t testing.TB, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func FuzzParseParams(f *testing.F) {
	f.Add(`{"do_remote_prefill":true,"remote_block_ids":[[1,2]],"remote_engine_id":"e","remote_request_id":"r","remote_host":"h","remote_port":1}`)
	f.Add(`{"remote_block_ids":[1,2,3]}`)
	f.Add(`{"remote_block_ids":[[]],"remote_blocks_expiry_time":1e308}`)
	f.Fuzz(func(t *testing.T, doc string) {
		var m map[string]any
		if json.Unmarshal([]byte(doc), &m) != nil {
			return
		}
		p, err := ParseParams(m)
		if err != nil {
			if !errors.Is(err, ErrParams) {
				t.Fatalf("error %v is not ErrParams", err)
			}
			return
		}
		if p == nil {
			return
		}
		back, err := ParseParams(decodeJSON(t, mustJSON(t, p.Map())))
		if err != nil {
			t.Fatalf("re-parsing our own encoding failed: %v", err)
		}
		if !reflect.DeepEqual(back.RemoteBlockIDs, p.RemoteBlockIDs) && len(p.RemoteBlockIDs) > 0 {
			t.Fatalf("block ids changed: %v → %v", p.RemoteBlockIDs, back.RemoteBlockIDs)
		}
	})
}
