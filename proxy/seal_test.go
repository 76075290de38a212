package proxy

import (
	"bytes"
	"errors"
	"testing"
)

// TestSealerBindsTheEntry: sealed params open only under the same key, for the same
// conversation and the same turn; the sealed bytes hold none of the params in clear text; an
// empty secret is a random key of this process.
func TestSealerBindsTheEntry(t *testing.T) {
	params := map[string]any{"kvbridge_lease": "00112233445566778899aabbccddeeff", "remote_block_ids": []any{1, 2}}
	base := turn{params: params, decoder: Instance{Host: "d", Port: 8000}, prefixLen: 3}
	s, _ := newSealer("secret")
	sealed, err := s.seal("conv", base)
	if err != nil || sealed.params != nil {
		t.Fatalf("seal: %v, params kept %v", err, sealed.params)
	}
	if bytes.Contains(sealed.sealed, []byte("00112233445566778899aabbccddeeff")) || bytes.Contains(sealed.sealed, []byte("remote_block_ids")) {
		t.Fatal("the sealed entry holds the params in clear text")
	}
	if got, err := s.open("conv", sealed); err != nil || got.params["kvbridge_lease"] != params["kvbridge_lease"] {
		t.Fatalf("open: %v %v", got.params, err)
	}
	same, _ := newSealer("secret")
	if _, err := same.open("conv", sealed); err != nil {
		t.Errorf("another replica with the same secret: %v", err)
	}
	other, _ := newSealer("other")
	random1, _ := newSealer("")
	random2, _ := newSealer("")
	r1, _ := random1.seal("conv", base)
	moved := sealed
	moved.decoder.Host = "elsewhere"
	for name, tc := range map[string]struct {
		s    *sealer
		conv string
		t    turn
	}{
		"another key":          {other, "conv", sealed},
		"another conversation": {s, "conv2", sealed},
		"another decoder":      {s, "conv", moved},
		"another process":      {random2, "conv", r1},
		"truncated":            {s, "conv", turn{sealed: sealed.sealed[:10]}},
	} {
		if _, err := tc.s.open(tc.conv, tc.t); !errors.Is(err, errUnsealable) {
			t.Errorf("%s: %v, want errUnsealable", name, err)
		}
	}
	if _, err := random1.open("conv", r1); err != nil {
		t.Errorf("a random key opens its own entries: %v", err)
	}
}
