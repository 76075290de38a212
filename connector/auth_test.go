package connector

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kvbridge/kvbridge/internal/fixture"
	"github.com/kvbridge/kvbridge/internal/kvlease"
	"github.com/kvbridge/kvbridge/kvcache"
	"github.com/kvbridge/kvbridge/transfer"
)

// startProducer builds a real connector (transfer agent and side channel on 127.0.0.1, no
// engine) over a small pool, with kvConfig as --kv-transfer-config and getenv as the
// environment.
func startProducer(t *testing.T, kvConfig string, getenv func(string) string) *Connector {
	t.Helper()
	geo := kvcache.Geometry{NumLayers: 1, NumKVHeads: 1, HeadDim: 8, BlockSize: 4}
	const numBlocks = 8
	layout := NewArenaLayout(geo.BlockBytes(), numBlocks)
	arena, err := transfer.NewArena("auth-test", layout.Size)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := kvcache.NewPool(arena.Bytes(), kvcache.PoolConfig{Geometry: geo, NumBlocks: numBlocks, RecordTable: layout.RecordTable(arena.Bytes())})
	if err != nil {
		t.Fatal(err)
	}
	for i := range numBlocks {
		b := pool.Bytes(int32(i))
		for j := range b {
			b[j] = byte(i)
		}
	}
	cfg, err := ParseConfig([]byte(kvConfig), nil)
	if err != nil {
		t.Fatal(err)
	}
	c, err := New(Options{Config: cfg, Pool: pool, Arena: arena, Layout: layout, Compat: CompatFactors{Model: "m"},
		SideChannelAddr: "127.0.0.1:0", Logger: testLogger(&fixture.LogBuffer{}), Getenv: getenv})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Error(err)
		}
		arena.Close()
	})
	return c
}

// reader is a bare transfer agent that reads a producer's blocks over TCP, as a consumer's
// connector would (or as anyone who reaches the port could).
type reader struct {
	agent    *transfer.Agent
	local    *transfer.PreparedList // the producer's block count of blocks, then records, then slots
	kv, meta *transfer.PreparedList
	n        int
	mem      []byte // the reader's arena
}

// newReader connects to c's agent with auth (nil: none).
func newReader(t *testing.T, c *Connector, auth transfer.Authenticator) (*reader, error) {
	t.Helper()
	a, err := transfer.NewAgent("reader", transfer.Config{Auth: auth})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	ar, err := transfer.NewArena("reader", 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ar.Close() })
	reg, err := a.Register(ar, 0, ar.Size(), 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Deregister(reg) })
	peer, err := a.LoadRemote(c.agent.LocalMetadata())
	if err != nil {
		t.Fatal(err)
	}
	bb, n := int64(c.pool.BlockBytes()), c.pool.NumBlocks()
	r := &reader{agent: a, n: n, mem: ar.Bytes()}
	if r.local, err = a.PrepareLocal(append(transfer.BlockDescs(reg.ID(), 0, bb, n), transfer.BlockDescs(reg.ID(), bb*int64(n), kvcache.RecordBytes, 2*n)...)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.local.Release)
	tcp := &transfer.PrepareOptions{Backends: []string{"TCP"}}
	if r.kv, err = a.PrepareRemote(t.Context(), peer, transfer.BlockDescs(c.core.kvRegion, 0, bb, n), tcp); err != nil {
		return nil, err
	}
	t.Cleanup(r.kv.Release)
	if r.meta, err = a.PrepareRemote(t.Context(), peer, transfer.BlockDescs(c.core.metaRegion, 0, kvcache.RecordBytes, 2*n), tcp); err != nil {
		return nil, err
	}
	t.Cleanup(r.meta.Release)
	return r, nil
}

// read reads entries presenting tag: blocks, or with meta, entries of the producer's metadata
// (block records 0…n−1, then lease slots n…2n−1).
func (r *reader) read(t *testing.T, tag []byte, meta bool, entries ...int) error {
	t.Helper()
	local := make([]int, len(entries))
	remote := r.kv
	for i, b := range entries {
		local[i] = b
		if meta {
			local[i] += r.n
		}
	}
	if meta {
		remote = r.meta
	}
	var opts *transfer.RequestOptions
	if tag != nil {
		opts = &transfer.RequestOptions{Tag: tag, Timeout: 30 * time.Second}
	}
	req, err := r.agent.MakeRequest(transfer.Read, r.local, local, remote, entries, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer req.Release()
	if err := req.Post(t.Context(), nil); err != nil {
		return err
	}
	return req.Wait(t.Context())
}

// TestReadsNeedALease: over TCP a reader gets exactly the blocks (and their records, and the
// lease's slot) leased under the token it presents, with or without an auth token; anything
// else is refused with ErrPermission, counted, and leaves the producer serving.
func TestReadsNeedALease(t *testing.T) {
	for _, token := range []string{"", "tok-0123456789abcdef"} {
		name := "no token"
		if token != "" {
			name = "token"
		}
		t.Run(name, func(t *testing.T) {
			cfg := `{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"backends":["TCP"],"auth_token":"` + token + `"}}`
			c := startProducer(t, cfg, nil)
			var auth transfer.Authenticator
			if token != "" {
				a, err := transfer.NewHMACAuth([]byte(token))
				if err != nil {
					t.Fatal(err)
				}
				auth = a
			}
			r, err := newReader(t, c, auth)
			if err != nil {
				t.Fatal(err)
			}
			tokA, tokB := kvlease.Token{1}, kvlease.Token{2}
			now := time.Now()
			c.mu.Lock()
			a, _ := c.core.leases.Add("req-A", tokA, []int32{2, 3, 6}, now, now.Add(time.Hour), true)
			c.mu.Unlock()
			if err := r.read(t, tokA[:], false, 2, 3); err != nil {
				t.Fatalf("leased blocks: %v", err)
			}
			if bb := c.pool.BlockBytes(); r.mem[2*bb] != 2 || r.mem[4*bb-1] != 3 {
				t.Fatal("the leased blocks read wrong bytes")
			}
			if err := r.read(t, tokA[:], true, 2, 3, 6, r.n+a.Slot); err != nil {
				t.Fatalf("leased records and the lease's slot: %v", err)
			}
			refused := []struct {
				tag     []byte
				meta    bool
				entries []int
				msg     string
			}{
				{tokA[:], false, []int{3, 4}, "entry 4 is not part of the lease"},
				{tokA[:], true, []int{5}, "entry 5 is not part of the lease"},
				{tokA[:], true, []int{r.n + a.Slot + 1}, "is not part of the lease"},
				{tokB[:], false, []int{2}, "no KV blocks are leased under the presented token"},
				{[]byte("req-A"), false, []int{2}, "presents no lease token"},
				{nil, false, []int{2}, "presents no lease token"},
			}
			for i, tc := range refused {
				err := r.read(t, tc.tag, tc.meta, tc.entries...)
				if !errors.Is(err, transfer.ErrPermission) || !strings.Contains(err.Error(), tc.msg) {
					t.Fatalf("read %+v: %v", tc, err)
				}
				if got := c.AuthRefusals(); got.Reads != int64(i+1) || got.Total() != int64(i+1) {
					t.Fatalf("after refusal %d: %+v", i+1, got)
				}
			}
			// A lease that ended (read, expired or released) no longer opens its blocks.
			c.mu.Lock()
			c.core.leases.Release("req-A")
			c.mu.Unlock()
			if err := r.read(t, tokA[:], false, 2); !errors.Is(err, transfer.ErrPermission) {
				t.Fatalf("read after the lease ended: %v", err)
			}
			c.mu.Lock()
			c.core.leases.Add("req-C", tokB, []int32{6}, now, now.Add(time.Hour), true)
			c.mu.Unlock()
			if err := r.read(t, tokB[:], false, 6); err != nil {
				t.Fatalf("the producer stopped serving after refusals: %v", err)
			}
			if got := r.agent.Stats().Failures.Permission; got != 7 {
				t.Fatalf("reader saw %d permission failures, want 7", got)
			}
		})
	}
}

// TestTransferConnectionsNeedTheToken: a transfer agent without the token, or with another
// one, cannot connect to a producer that has one; the producer counts it.
func TestTransferConnectionsNeedTheToken(t *testing.T) {
	c := startProducer(t, `{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"auth_token":"tok-0123456789abcdef"}}`, nil)
	if _, err := newReader(t, c, nil); !errors.Is(err, transfer.ErrPermission) || !strings.Contains(err.Error(), "authentication required") {
		t.Fatalf("no token: %v", err)
	}
	other, _ := transfer.NewHMACAuth([]byte("another token"))
	if _, err := newReader(t, c, other); !errors.Is(err, transfer.ErrPermission) || !strings.Contains(err.Error(), "secrets differ") {
		t.Fatalf("wrong token: %v", err)
	}
	if got := c.AuthRefusals(); got.Transfer != 2 || got.Total() != 2 {
		t.Fatalf("refusals %+v", got)
	}
}

// TestAuthTokenFromEnvironment: KVBRIDGE_KV_AUTH_TOKEN applies when auth_token is absent;
// the config key wins when both are set.
func TestAuthTokenFromEnvironment(t *testing.T) {
	env := func(v string) func(string) string {
		return func(k string) string {
			if k == EnvAuthToken {
				return v
			}
			return ""
		}
	}
	if tok, src := resolveAuthToken(&Config{}, env("e")); tok != "e" || src != EnvAuthToken {
		t.Fatalf("env: %q %q", tok, src)
	}
	if tok, src := resolveAuthToken(&Config{AuthToken: "c"}, env("e")); tok != "c" || src != "kv_connector_extra_config.auth_token" {
		t.Fatalf("config and env: %q %q", tok, src)
	}
	if tok, _ := resolveAuthToken(&Config{}, env("")); tok != "" {
		t.Fatalf("neither: %q", tok)
	}
	producer := `{"kv_connector":"NixlConnector","kv_role":"kv_producer"}`
	c := startProducer(t, producer, env("from-env"))
	fromEnv, _ := transfer.NewHMACAuth([]byte("from-env"))
	if _, err := newReader(t, c, fromEnv); err != nil {
		t.Fatalf("token from the environment: %v", err)
	}
	withKey := `{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_connector_extra_config":{"auth_token":"from-config"}}`
	c2 := startProducer(t, withKey, env("from-env"))
	if _, err := newReader(t, c2, fromEnv); !errors.Is(err, transfer.ErrPermission) {
		t.Fatalf("the environment won over the config key: %v", err)
	}
	fromConfig, _ := transfer.NewHMACAuth([]byte("from-config"))
	if _, err := newReader(t, c2, fromConfig); err != nil {
		t.Fatalf("token from the config key: %v", err)
	}
	// The side channel takes the same token.
	ctx := t.Context()
	if _, err := handshake(ctx, c2.SideChannelAddr(), c2.EngineID(), c2.hash, true, 1, c2.clockSeconds, newSideAuth("from-config")); err != nil {
		t.Fatalf("side channel with the config token: %v", err)
	}
	if _, err := handshake(ctx, c2.SideChannelAddr(), c2.EngineID(), c2.hash, true, 1, c2.clockSeconds, newSideAuth("from-env")); !errors.Is(err, ErrAuth) {
		t.Fatalf("side channel with the environment token: %v", err)
	}
}
