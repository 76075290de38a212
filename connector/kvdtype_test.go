package connector

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/kvcache"
)

// TestKVDTypeInHandshake: the producer's KV dtype reaches the consumer with the handshake, with
// the hashes equal or not (check on or off), and a consumer of another dtype refuses it naming
// both, as ErrIncompatible, wrapping a hash mismatch's error when there is one; a peer that does
// not say (vLLM's payload has no kv_cache_dtype) is judged by the hash alone.
func TestKVDTypeInHandshake(t *testing.T) {
	p := testPayload(t, "E")
	p.KVCacheDType = kvcache.FP8E5M2.String()
	srv, err := listenSideChannel("127.0.0.1:0", p, func() float64 { return 1 }, testLogger(&bytes.Buffer{}), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.close()
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	local := &Connector{geo: kvcache.Geometry{DType: kvcache.FP8E4M3}}
	for _, tc := range []struct {
		hash    string
		enforce bool
	}{{"hash-1", true}, {"hash-2", false}, {"hash-2", true}} {
		res, err := handshake(ctx, srv.addr().String(), "E", tc.hash, tc.enforce, 1, func() float64 { return 1 }, nil)
		if res.kvCacheDType != "fp8_e5m2" {
			t.Fatalf("hash %s, enforce %v: the producer's dtype %q did not arrive (%v)", tc.hash, tc.enforce, res.kvCacheDType, err)
		}
		mismatch := tc.enforce && tc.hash != "hash-1"
		if (err != nil) != mismatch {
			t.Fatalf("hash %s, enforce %v: %v", tc.hash, tc.enforce, err)
		}
		err = local.kvDTypeMismatch("E", res.kvCacheDType, err)
		if !errors.Is(err, ErrIncompatible) || !strings.Contains(err.Error(), "fp8_e5m2 KV, this engine fp8_e4m3") ||
			mismatch != strings.Contains(err.Error(), "hash mismatch") {
			t.Errorf("hash %s, enforce %v: %v", tc.hash, tc.enforce, err)
		}
		same := &Connector{geo: kvcache.Geometry{DType: kvcache.FP8E5M2}}
		if got := same.kvDTypeMismatch("E", res.kvCacheDType, nil); got != nil {
			t.Errorf("same dtype refused: %v", got)
		}
	}
	hashErr := errors.New("hash mismatch")
	if got := local.kvDTypeMismatch("E", "", hashErr); got != hashErr {
		t.Errorf("a peer that does not say: %v", got)
	}
	if got := local.kvDTypeMismatch("E", "", nil); got != nil {
		t.Errorf("a peer that does not say, hashes equal: %v", got)
	}
}
