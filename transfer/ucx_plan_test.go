package transfer

import (
	"slices"
	"strings"
	"testing"
	"unsafe"
)

// TestParseBackendsUCX: "UCX" is a backend in a build with -tags ucx; without it, it is
// refused with ErrNotSupported and a message naming the tag.
func TestParseBackendsUCX(t *testing.T) {
	bs, err := ParseBackends([]string{"ucx", "TCP"})
	if !ucxBuilt {
		wantKind(t, err, ErrNotSupported)
		if !strings.Contains(err.Error(), "-tags ucx") || !strings.Contains(err.Error(), ucxMinVersion) {
			t.Fatalf("error %q does not say how to get UCX", err)
		}
		return
	}
	if err != nil || !slices.Equal(bs, []Backend{BackendUCX, BackendTCP}) || bs[0].String() != "UCX" {
		t.Fatalf("%v, %v", bs, err)
	}
}

// TestMetadataUCXFormat: format 3 carries UCX worker addresses and arena keys, round-trips,
// and every inconsistency in it is ErrProtocol.
func TestMetadataUCXFormat(t *testing.T) {
	p := newPair(t, Config{}, Config{}, 1<<16, PermRead)
	base := rewriteMeta(t, p.tgt.LocalMetadata(), func(m *metaWire) {
		m.Version = metadataVersionUCX
		m.UCXWorkers = [][]byte{[]byte("worker-0"), []byte("worker-1")}
		m.UCXArenas = []metaUCXArena{{ID: m.Arenas[0].ID, Base: 0x7f0000000000, Rkey: []byte{1, 2, 3}}}
		m.ProcStart = 42
	})
	m, err := decodeMetadata(base)
	if err != nil {
		t.Fatal(err)
	}
	ua := m.ucxArena[m.Arenas[0].ID]
	if len(m.UCXWorkers) != 2 || string(m.UCXWorkers[1]) != "worker-1" || ua == nil || ua.Base != 0x7f0000000000 ||
		string(ua.Rkey) != "\x01\x02\x03" || m.ProcStart != 42 || len(m.Regions) != 1 {
		t.Fatalf("decoded %+v", m.metaWire)
	}
	for name, fn := range map[string]func(*metaWire){
		"key for an unknown arena": func(m *metaWire) { m.UCXArenas[0].ID = 99 },
		"key listed twice":         func(m *metaWire) { m.UCXArenas = append(m.UCXArenas, m.UCXArenas[0]) },
		"empty key":                func(m *metaWire) { m.UCXArenas[0].Rkey = nil },
		"oversized key":            func(m *metaWire) { m.UCXArenas[0].Rkey = make([]byte, maxUCXBlob+1) },
		"keys without workers":     func(m *metaWire) { m.UCXWorkers = nil },
		"empty worker address":     func(m *metaWire) { m.UCXWorkers[0] = nil },
		"too many workers":         func(m *metaWire) { m.UCXWorkers = make([][]byte, maxUCXWorkers+1) },
		"arena base overflows":     func(m *metaWire) { m.UCXArenas[0].Base = 1<<64 - 1 },
	} {
		_, err := p.ini.LoadRemote(rewriteMeta(t, base, fn))
		if err == nil {
			t.Fatalf("%s: accepted", name)
		}
		wantKind(t, err, ErrProtocol)
	}
}

// TestUCXSettings: kvbridge's UCX defaults give way to the environment and Config.UCX, and
// apply only to transports UCX_TLS allows.
func TestUCXSettings(t *testing.T) {
	env := func(kv ...string) func(string) string {
		return func(k string) string {
			for i := 0; i+1 < len(kv); i += 2 {
				if kv[i] == k {
					return kv[i+1]
				}
			}
			return ""
		}
	}
	get := func(s [][2]string, k string) string {
		for _, x := range s {
			if x[0] == k {
				return x[1]
			}
		}
		return ""
	}
	s, err := ucxSettings(nil, env())
	if err != nil || get(s, "TX_SEG_SIZE") != "520K" || get(s, "MM_ERROR_HANDLING") != "y" || get(s, "KEEPALIVE_INTERVAL") != "" {
		t.Fatalf("defaults %v %v", s, err)
	}
	// The environment wins (UCX reads it itself), including a transport's own prefixed name.
	s, _ = ucxSettings(nil, env("UCX_TCP_TX_SEG_SIZE", "64K", "UCX_POSIX_ERROR_HANDLING", "n"))
	if get(s, "TX_SEG_SIZE") != "" || get(s, "MM_ERROR_HANDLING") != "" || get(s, "RX_SEG_SIZE") != "520K" {
		t.Fatalf("with environment %v", s)
	}
	// UCX_TLS=tcp leaves the shared-memory settings out (UCX warns about unused ones).
	s, _ = ucxSettings(nil, env("UCX_TLS", "tcp"))
	if get(s, "MM_ERROR_HANDLING") != "" || get(s, "TX_SEG_SIZE") != "520K" {
		t.Fatalf("with UCX_TLS=tcp %v", s)
	}
	// Config.UCX wins over both, with or without the UCX_ prefix, and its TLS decides.
	s, _ = ucxSettings(map[string]string{"ucx_tls": "sm", "KEEPALIVE_INTERVAL": "3s"}, env("UCX_TLS", "tcp"))
	if get(s, "TLS") != "sm" || get(s, "KEEPALIVE_INTERVAL") != "3s" || get(s, "TX_SEG_SIZE") != "" || get(s, "MM_ERROR_HANDLING") != "y" {
		t.Fatalf("with Config.UCX %v", s)
	}
	_, err = ucxSettings(map[string]string{"A B": "1"}, env())
	wantKind(t, err, ErrInvalidParam)
}

// TestParseUCXLanes reads the lanes out of a report printed by UCX 1.13's ucp_ep_print_info.
func TestParseUCXLanes(t *testing.T) {
	const report = `#
# UCP endpoint 
#
#               peer: <no debug data>
#                 lane[0]:  0:sysv/memory.0 md[0]           -> md[0]/sysv/sysdev[255] am am_bw#0 keepalive
#                 lane[1]:  1:posix/memory.0 md[1]          -> md[1]/posix/sysdev[255]
#                 lane[2]:  2:tcp/eth0.0 md[2]              -> md[2]/tcp/sysdev[255] rma_bw#0 wireup
#
#                 am_send: 0..<egr/short>..93..<egr/bcopy>..8256..<rndv>..(inf)
#                  get[0]: 0..<bcopy>..(inf)
#`
	got := parseUCXLanes(report)
	want := []string{"sysv/memory.0: am am_bw#0 keepalive", "posix/memory.0:", "tcp/eth0.0: rma_bw#0 wireup"}
	if !slices.Equal(got, want) {
		t.Fatalf("lanes %q, want %q", got, want)
	}
	if !ucxHasRMALane(got) || ucxHasRMALane(got[:2]) {
		t.Fatalf("RMA lane detection wrong on %q", got)
	}
}

// TestPlanUCX: a request's bytes are cut into pieces of at most ucxPieceMax and spread over
// the workers in contiguous units that cover every byte once, in order.
func TestPlanUCX(t *testing.T) {
	local := make([]byte, 6<<20)
	for _, tc := range []struct {
		runs    []int // run lengths
		workers int
		units   int
	}{
		{[]int{4096}, 4, 1},
		{[]int{ucxSplitMin}, 4, 1},
		{[]int{ucxSplitMin + 1}, 4, 2},
		{[]int{3 << 20, 1 << 20, 4096}, 2, 2},
		{[]int{1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 20}, 3, 3},
	} {
		r := &Request{id: 7}
		off := 0
		for i, n := range tc.runs {
			r.runs = append(r.runs, run{local: local[off : off+n], raddr: uint64(1<<40 + off), rarena: uint32(1 + i%2)})
			off += n
			r.bytes += int64(n)
		}
		r.planUCX(tc.workers)
		if len(r.ucx.units) != tc.units {
			t.Fatalf("%v on %d workers: %d units, want %d", tc.runs, tc.workers, len(r.ucx.units), tc.units)
		}
		next := uint64(1 << 40)
		seen := map[int]bool{}
		for i := range r.ucx.units {
			u := &r.ucx.units[i]
			if seen[u.worker] || u.worker >= tc.workers {
				t.Fatalf("%v: worker %d used twice or out of range", tc.runs, u.worker)
			}
			seen[u.worker] = true
			for _, pc := range u.pieces {
				if pc.raddr != next || pc.len == 0 || pc.len > ucxPieceMax {
					t.Fatalf("%v: piece %+v, expected it at %#x", tc.runs, pc, next)
				}
				if pc.laddr-uint64(uintptr(unsafe.Pointer(unsafe.SliceData(local)))) != pc.raddr-1<<40 {
					t.Fatalf("%v: piece %+v pairs the wrong local bytes", tc.runs, pc)
				}
				next += pc.len
			}
		}
		if want := min(len(tc.runs), 2); len(r.ucx.arenas) != want {
			t.Fatalf("%v: %d arenas, want %d", tc.runs, len(r.ucx.arenas), want)
		}
		if next != 1<<40+uint64(r.bytes) {
			t.Fatalf("%v: pieces cover %d of %d bytes", tc.runs, next-1<<40, r.bytes)
		}
	}
}
