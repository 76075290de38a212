package transfer

import (
	"bufio"
	"context"
	"encoding/base64"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The test binary re-executes itself as the peer process of the cross-process tests.
const (
	envPeer     = "KVBRIDGE_TRANSFER_TEST_PEER" // agent name; set = run as the peer
	envPeerSize = "KVBRIDGE_TRANSFER_TEST_SIZE"
	envPeerSeed = "KVBRIDGE_TRANSFER_TEST_SEED"
	envPeerBE   = "KVBRIDGE_TRANSFER_TEST_BACKENDS" // comma-separated Config.Backends (default: automatic)
)

func TestMain(m *testing.M) {
	if name := os.Getenv(envPeer); name != "" {
		if err := runTestPeer(name); err != nil {
			fmt.Fprintln(os.Stderr, "test peer:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// runTestPeer is the peer process: an agent with one arena filled with the seed's pattern,
// registered read-write. It prints "META <base64>", echoes every notification back to its
// sender as "ECHO:<msg>", and answers commands on stdin:
//
//	sums <block>  → "SUMS <crc>,<crc>,…" (CRC32 of every block of the arena)
//	fill <seed>   → refills the arena, "OK"
//	quit          → exits
func runTestPeer(name string) error {
	size, err := strconv.ParseInt(os.Getenv(envPeerSize), 10, 64)
	if err != nil {
		return err
	}
	seed, err := strconv.ParseUint(os.Getenv(envPeerSeed), 10, 64)
	if err != nil {
		return err
	}
	var cfg Config
	if be := os.Getenv(envPeerBE); be != "" {
		cfg.Backends = strings.Split(be, ",")
	}
	a, err := NewAgent(name, cfg)
	if err != nil {
		return err
	}
	defer a.Close()
	ar, err := NewArena(name, size)
	if err != nil {
		return err
	}
	fillPattern(ar.Bytes(), seed)
	reg, err := a.Register(ar, 0, size, PermReadWrite)
	if err != nil {
		return err
	}
	go func() {
		for n := range a.Notifications() {
			_ = a.SendNotif(context.Background(), n.Peer, append([]byte("ECHO:"), n.Msg...))
		}
	}()
	out := bufio.NewWriter(os.Stdout)
	fmt.Fprintf(out, "META %s\n", base64.StdEncoding.EncodeToString(a.LocalMetadata()))
	out.Flush()
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		f := strings.Fields(in.Text())
		if len(f) == 0 {
			continue
		}
		switch f[0] {
		case "sums":
			bs, _ := strconv.Atoi(f[1])
			sums := blockSums(ar.Bytes(), bs)
			parts := make([]string, len(sums))
			for i, s := range sums {
				parts[i] = strconv.FormatUint(uint64(s), 16)
			}
			fmt.Fprintf(out, "SUMS %s\n", strings.Join(parts, ","))
		case "fill":
			s, _ := strconv.ParseUint(f[1], 10, 64)
			fillPattern(ar.Bytes(), s)
			fmt.Fprintln(out, "OK")
		case "pull":
			// pull <base64 metadata>: READ the whole of that agent's region 1 into this arena
			// until killed; "PULLING" after the first READ completed.
			if err := pull(a, reg, f[1], out); err != nil {
				return err
			}
		case "notify":
			// notify <base64 metadata> <msg>: load that agent's metadata (once) and send it
			// msg over this agent's own route to it, within 10 s; "SENT", or "ERR <error>".
			if err := notifyLoaded(a, f[1], f[2]); err != nil {
				fmt.Fprintf(out, "ERR %v\n", err)
			} else {
				fmt.Fprintln(out, "SENT")
			}
		case "quit":
			return nil
		}
		out.Flush()
	}
	return nil
}

// loadMeta loads the base64 metadata meta into a and returns the remote agent's name.
func loadMeta(a *Agent, meta string) (string, error) {
	blob, err := base64.StdEncoding.DecodeString(meta)
	if err != nil {
		return "", err
	}
	return a.LoadRemote(blob)
}

// pull is the peer's "pull" command.
func pull(a *Agent, reg *Region, meta string, out *bufio.Writer) error {
	name, err := loadMeta(a, meta)
	if err != nil {
		return err
	}
	ctx := context.Background()
	n := int(reg.Len() >> 20)
	req, err := a.CreateRequest(ctx, Read, BlockDescs(reg.ID(), 0, 1<<20, n), name, BlockDescs(1, 0, 1<<20, n), nil)
	if err != nil {
		return err
	}
	for i := 0; ; i++ {
		if err := req.Post(ctx, nil); err != nil {
			return err
		}
		if err := req.Wait(ctx); err != nil {
			return err
		}
		if i == 0 {
			fmt.Fprintln(out, "PULLING")
			out.Flush()
		}
	}
}

// notifyLoaded is the peer's "notify" command.
func notifyLoaded(a *Agent, meta, msg string) error {
	name, err := loadMeta(a, meta)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return a.SendNotif(ctx, name, []byte(msg))
}

// testPeer is a running peer process.
type testPeer struct {
	t    *testing.T
	cmd  *exec.Cmd
	in   io.WriteCloser
	out  *bufio.Reader
	meta []byte
	done chan struct{}
}

// startTestPeer runs the peer named name with an arena of size bytes and pattern seed; env
// adds environment variables (KEY=VALUE) to the peer's.
func startTestPeer(t *testing.T, name string, seed uint64, size int64, env ...string) *testPeer {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), envPeer+"="+name, fmt.Sprintf("%s=%d", envPeerSize, size), fmt.Sprintf("%s=%d", envPeerSeed, seed))
	cmd.Env = append(cmd.Env, env...)
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &testPeer{t: t, cmd: cmd, in: in, out: bufio.NewReader(stdout), done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGCONT)
		_ = cmd.Process.Kill()
		<-p.done
	})
	line := p.line()
	meta, ok := strings.CutPrefix(line, "META ")
	if !ok {
		t.Fatalf("peer said %q", line)
	}
	if p.meta, err = base64.StdEncoding.DecodeString(meta); err != nil {
		t.Fatal(err)
	}
	return p
}

// line reads one line from the peer, bounded by the test context.
func (p *testPeer) line() string {
	p.t.Helper()
	type res struct {
		s   string
		err error
	}
	ch := make(chan res, 1)
	go func() {
		s, err := p.out.ReadString('\n')
		ch <- res{strings.TrimSpace(s), err}
	}()
	select {
	case r := <-ch:
		if r.err != nil {
			p.t.Fatalf("peer: %v", r.err)
		}
		return r.s
	case <-testCtx(p.t).Done():
		p.t.Fatal("peer did not answer")
	}
	return ""
}

// call sends a command and returns the answer line.
func (p *testPeer) call(cmd string) string {
	p.t.Helper()
	if _, err := fmt.Fprintln(p.in, cmd); err != nil {
		p.t.Fatal(err)
	}
	return p.line()
}

// sums returns the peer's per-block checksums.
func (p *testPeer) sums(block int) []uint32 {
	p.t.Helper()
	s, ok := strings.CutPrefix(p.call(fmt.Sprintf("sums %d", block)), "SUMS ")
	if !ok {
		p.t.Fatal("bad sums answer")
	}
	var out []uint32
	for _, h := range strings.Split(s, ",") {
		v, err := strconv.ParseUint(h, 16, 32)
		if err != nil {
			p.t.Fatal(err)
		}
		out = append(out, uint32(v))
	}
	return out
}

// signal sends sig to the peer.
func (p *testPeer) signal(sig syscall.Signal) {
	p.t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatal(err)
	}
}

// stop SIGSTOPs the peer and waits until the kernel reports it stopped (signals are
// delivered asynchronously).
func (p *testPeer) stop() {
	p.t.Helper()
	p.signal(syscall.SIGSTOP)
	ctx := testCtx(p.t)
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.cmd.Process.Pid))
		if err != nil {
			p.t.Fatal(err)
		}
		// The state follows the parenthesised command name.
		if i := strings.LastIndexByte(string(b), ')'); i > 0 && i+2 < len(b) && (b[i+2] == 'T' || b[i+2] == 't') {
			return
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			p.t.Fatal("peer did not stop")
		}
	}
}

// kill SIGKILLs the peer and waits until it is reaped.
func (p *testPeer) kill() {
	p.t.Helper()
	p.signal(syscall.SIGKILL)
	select {
	case <-p.done:
	case <-testCtx(p.t).Done():
		p.t.Fatal("peer did not die")
	}
}

// expectedSums returns the checksums of an arena filled with seed's pattern.
func expectedSums(size int64, seed uint64, block int) []uint32 {
	b := make([]byte, size)
	fillPattern(b, seed)
	return blockSums(b, block)
}

// TestCrossProcess: READ and WRITE against a peer process on both backends, checksum of
// every block, notifications in both directions.
func TestCrossProcess(t *testing.T) {
	const size = 8 << 20
	peer := startTestPeer(t, "xpeer", 0x33, size)
	x := newCrossProcess(t, peer, Config{}, size)
	for bi, be := range []string{"SHM", "TCP"} {
		x.readWrite(t, be, uint64(100+bi))
	}
}

// crossProcess is an initiator agent with an arena and a local block list, facing a peer
// process whose metadata it loaded.
type crossProcess struct {
	peer  *testPeer
	ini   *Agent
	ar    *Arena
	name  string
	ll    *PreparedList
	size  int64
	block int64
	n     int
	rng   *rand.Rand
}

// newCrossProcess sets up the initiator side against peer (64 KiB blocks).
func newCrossProcess(t *testing.T, peer *testPeer, cfg Config, size int64) *crossProcess {
	t.Helper()
	x := &crossProcess{peer: peer, size: size, block: 64 << 10, rng: rand.New(rand.NewPCG(3, 4))}
	x.ini = newTestAgent(t, "xinit", cfg)
	x.ar = newTestArena(t, size)
	reg := mustRegister(t, x.ini, x.ar, 0)
	var err error
	if x.name, err = x.ini.LoadRemote(peer.meta); err != nil {
		t.Fatal(err)
	}
	x.n = int(size / x.block)
	if x.ll, err = x.ini.PrepareLocal(BlockDescs(reg.ID(), 0, x.block, x.n)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(x.ll.Release)
	return x
}

// readWrite READs half the peer's blocks in scattered order (checking every checksum and the
// echo of the notification), then WRITEs other scattered blocks and compares them with the
// peer's own checksums, over backend be; the peer's arena holds seed's pattern at first.
func (x *crossProcess) readWrite(t *testing.T, be string, seed uint64) {
	t.Helper()
	ini, peer, block, n := x.ini, x.peer, int(x.block), x.n
	rl, err := ini.PrepareRemote(testCtx(t), x.name, BlockDescs(1, 0, x.block, n), &PrepareOptions{Backends: []string{be}})
	if err != nil {
		t.Fatal(err)
	}
	defer rl.Release()
	if rl.Backend().String() != be {
		t.Fatalf("backend %v", rl.Backend())
	}
	if peer.call(fmt.Sprintf("fill %d", seed)) != "OK" {
		t.Fatal("fill")
	}
	want := expectedSums(x.size, seed, block)

	// READ scattered blocks, with a notification the peer echoes back.
	lidx, ridx := x.rng.Perm(n)[:n/2], x.rng.Perm(n)[:n/2]
	rd, err := ini.MakeRequest(Read, x.ll, lidx, rl, ridx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer rd.Release()
	tag := fmt.Sprintf("req-%s:1", be)
	if err := postWait(t, rd, []byte(tag)); err != nil {
		t.Fatal(err)
	}
	got := blockSums(x.ar.Bytes(), block)
	for k := range lidx {
		if got[lidx[k]] != want[ridx[k]] {
			t.Fatalf("%s READ: block %d (local %d, remote %d) checksum mismatch", be, k, lidx[k], ridx[k])
		}
	}
	if nt := recvNotif(t, ini); string(nt.Msg) != "ECHO:"+tag || nt.Peer != x.name {
		t.Fatalf("echo %+v", nt)
	}

	// WRITE other scattered blocks and compare with the peer's own checksums.
	fillPattern(x.ar.Bytes(), seed+50)
	local := blockSums(x.ar.Bytes(), block)
	lidx, ridx = x.rng.Perm(n)[:n/2], x.rng.Perm(n)[:n/2]
	wr, err := ini.MakeRequest(Write, x.ll, lidx, rl, ridx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer wr.Release()
	if err := postWait(t, wr, []byte("w")); err != nil {
		t.Fatal(err)
	}
	remote := peer.sums(block)
	written := map[int]bool{}
	for k := range lidx {
		written[ridx[k]] = true
		if remote[ridx[k]] != local[lidx[k]] {
			t.Fatalf("%s WRITE: block %d (local %d, remote %d) checksum mismatch", be, k, lidx[k], ridx[k])
		}
	}
	for i := range n {
		if !written[i] && remote[i] != want[i] {
			t.Fatalf("%s WRITE: untouched block %d changed", be, i)
		}
	}
	if nt := recvNotif(t, ini); string(nt.Msg) != "ECHO:w" {
		t.Fatalf("echo %+v", nt)
	}
}

// TestPeerKilledAfterLoad: the peer dies after its metadata was loaded; preparing (which
// connects) fails with ErrRemoteDisconnect on either backend.
func TestPeerKilledAfterLoad(t *testing.T) {
	peer := startTestPeer(t, "xdead", 1, 1<<20)
	ini := newTestAgent(t, "xinit", Config{})
	name, err := ini.LoadRemote(peer.meta)
	if err != nil {
		t.Fatal(err)
	}
	peer.kill()
	for _, be := range [][]string{{"SHM"}, {"TCP"}, nil} {
		_, err := ini.PrepareRemote(testCtx(t), name, BlockDescs(1, 0, 4096, 4), &PrepareOptions{Backends: be})
		wantKind(t, err, ErrRemoteDisconnect)
	}
}

// TestPeerKilledMidTransfer: a TCP READ is in flight to a stopped peer that is then killed
// (ErrRemoteDisconnect, not a timeout); an SHM READ racing the kill either completes or fails
// with ErrRemoteDisconnect, and later posts fail promptly.
func TestPeerKilledMidTransfer(t *testing.T) {
	const size = 8 << 20
	peer := startTestPeer(t, "xmid", 7, size)
	ini := newTestAgent(t, "xinit", Config{})
	ar := newTestArena(t, size)
	reg := mustRegister(t, ini, ar, 0)
	name, err := ini.LoadRemote(peer.meta)
	if err != nil {
		t.Fatal(err)
	}
	ll, err := ini.PrepareLocal(BlockDescs(reg.ID(), 0, 1<<20, 8))
	if err != nil {
		t.Fatal(err)
	}
	defer ll.Release()
	lists := map[string]*PreparedList{}
	for _, be := range []string{"SHM", "TCP"} {
		rl, err := ini.PrepareRemote(testCtx(t), name, BlockDescs(1, 0, 1<<20, 8), &PrepareOptions{Backends: []string{be}})
		if err != nil {
			t.Fatal(err)
		}
		defer rl.Release()
		lists[be] = rl
	}
	tcpReq, err := ini.MakeRequest(Read, ll, seq(8), lists["TCP"], seq(8), &RequestOptions{Timeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer tcpReq.Release()
	shmReq, err := ini.MakeRequest(Read, ll, seq(8), lists["SHM"], seq(8), &RequestOptions{Timeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer shmReq.Release()
	ctx := testCtx(t)
	peer.stop()
	if err := tcpReq.Post(ctx, nil); err != nil {
		t.Fatal(err)
	}
	if st, _ := tcpReq.status(); st != statusInProgress {
		t.Fatalf("status %v while the peer is stopped", st)
	}
	if err := shmReq.Post(ctx, []byte("x")); err != nil {
		t.Fatal(err)
	}
	peer.kill()
	wantKind(t, tcpReq.Wait(ctx), ErrRemoteDisconnect)
	if err := shmReq.Wait(ctx); err != nil {
		wantKind(t, err, ErrRemoteDisconnect)
	}
	// The peer is gone: a post that needs it (the notification) fails at once.
	if err := postWait(t, shmReq, []byte("y")); err == nil {
		t.Fatal("post to a dead peer succeeded")
	} else {
		wantKind(t, err, ErrRemoteDisconnect)
	}
	wantKind(t, postWait(t, tcpReq, nil), ErrRemoteDisconnect)
}

// TestPeerRestart: the peer restarts with a new incarnation. Old requests fail (first as
// disconnected, then, once the new metadata is loaded, as stale); new ones succeed.
func TestPeerRestart(t *testing.T) {
	const size, block = 4 << 20, 1 << 20
	p1 := startTestPeer(t, "xrestart", 11, size)
	ini := newTestAgent(t, "xinit", Config{})
	ar := newTestArena(t, size)
	reg := mustRegister(t, ini, ar, 0)
	if _, err := ini.LoadRemote(p1.meta); err != nil {
		t.Fatal(err)
	}
	ll, err := ini.PrepareLocal(BlockDescs(reg.ID(), 0, block, 4))
	if err != nil {
		t.Fatal(err)
	}
	defer ll.Release()
	old := map[string]*Request{}
	for _, be := range []string{"SHM", "TCP"} {
		rl, err := ini.PrepareRemote(testCtx(t), "xrestart", BlockDescs(1, 0, block, 4), &PrepareOptions{Backends: []string{be}})
		if err != nil {
			t.Fatal(err)
		}
		defer rl.Release()
		r, err := ini.MakeRequest(Read, ll, seq(4), rl, seq(4), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Release()
		if err := postWait(t, r, nil); err != nil {
			t.Fatal(err)
		}
		old[be] = r
	}
	p1.kill()
	for be, r := range old {
		err := postWait(t, r, []byte("n"))
		if err == nil {
			t.Fatalf("%s: post to the dead incarnation succeeded", be)
		}
		wantKind(t, err, ErrRemoteDisconnect)
	}
	p2 := startTestPeer(t, "xrestart", 22, size)
	if _, err := ini.LoadRemote(p2.meta); err != nil {
		t.Fatal(err)
	}
	for _, r := range old {
		wantKind(t, postWait(t, r, nil), ErrStaleIncarnation)
	}
	want := expectedSums(size, 22, block)
	for _, be := range []string{"SHM", "TCP"} {
		clear(ar.Bytes())
		rl, err := ini.PrepareRemote(testCtx(t), "xrestart", BlockDescs(1, 0, block, 4), &PrepareOptions{Backends: []string{be}})
		if err != nil {
			t.Fatal(err)
		}
		defer rl.Release()
		r, err := ini.MakeRequest(Read, ll, seq(4), rl, seq(4), nil)
		if err != nil {
			t.Fatal(err)
		}
		defer r.Release()
		if err := postWait(t, r, nil); err != nil {
			t.Fatal(err)
		}
		got := blockSums(ar.Bytes(), block)
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("%s: block %d is not the new incarnation's", be, i)
			}
		}
	}
	if f := ini.Stats().Failures; f.StaleIncarnation != 2 || f.RemoteDisconnect != 2 {
		t.Fatalf("failures %+v", f)
	}
}

// TestStalledPeerTimeout: a stopped peer makes a TCP READ end in ErrTimeout; once it runs
// again the same request succeeds (late answers to the timed-out post are discarded).
func TestStalledPeerTimeout(t *testing.T) {
	peer := startTestPeer(t, "xstall", 5, 4<<20)
	stalledPeerTimeout(t, peer, Config{Backends: []string{"TCP"}})
}

// stallRead stops peer, posts req with a 300 ms context (the request's own deadline is longer)
// and waits: the READ ends in ErrTimeout (an SHM READ, which copies without the peer, may
// complete instead); then it resumes the peer.
func stallRead(t *testing.T, peer *testPeer, req *Request) {
	t.Helper()
	peer.stop()
	short, cancel := context.WithTimeout(testCtx(t), 300*time.Millisecond)
	defer cancel()
	if err := req.Post(short, nil); err != nil {
		t.Fatal(err)
	}
	if err := req.Wait(testCtx(t)); req.backend != BackendSHM || err != nil {
		wantKind(t, err, ErrTimeout)
	}
	peer.signal(syscall.SIGCONT)
}

// stalledPeerTimeout READs 4 MiB from a stopped peer with a 300 ms deadline, its post's
// context's (ErrTimeout), resumes the peer and posts the same request again, which must bring
// the peer's pattern (seed 5). It returns the initiator.
func stalledPeerTimeout(t *testing.T, peer *testPeer, cfg Config) *Agent {
	t.Helper()
	const size = 4 << 20
	// The request's own deadline is long: the 300 ms are the first post's context's, so that the
	// second post's do not have to cover the resumed peer's getting the CPU back and a new link's
	// hello on a loaded machine (a context's deadline fails a post as the request's does).
	ini, ar, req := peerRead(t, peer, cfg, size, time.Minute)
	stallRead(t, peer, req)
	if err := postWait(t, req, nil); err != nil {
		t.Fatal(err)
	}
	want := expectedSums(size, 5, 1<<20)
	got := blockSums(ar.Bytes(), 1<<20)
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("block %d", i)
		}
	}
	return ini
}

// peerRead starts an initiator with cfg and makes a request that READs the first size bytes
// of peer's arena in 1 MiB blocks, with the given deadline.
func peerRead(t *testing.T, peer *testPeer, cfg Config, size int64, timeout time.Duration) (*Agent, *Arena, *Request) {
	t.Helper()
	ini := newTestAgent(t, "xinit", cfg)
	ar := newTestArena(t, size)
	reg := mustRegister(t, ini, ar, 0)
	name, err := ini.LoadRemote(peer.meta)
	if err != nil {
		t.Fatal(err)
	}
	n := int(size >> 20)
	req, err := ini.CreateRequest(testCtx(t), Read, BlockDescs(reg.ID(), 0, 1<<20, n), name, BlockDescs(1, 0, 1<<20, n),
		&RequestOptions{Timeout: timeout})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(req.Release)
	return ini, ar, req
}

// stalledPeerNotif stops the peer, posts a READ to it with a 300 ms context deadline, resumes
// the peer and then sends a notification alone (no request first), which must arrive: SendNotif
// succeeds and the peer's echo comes back (an error would at least not be a silent loss, but
// the peer is running again and reachable). Where the READ needs the peer it ends in
// ErrTimeout, which closes the TCP data connections (the notification takes the control
// connection) or the UCX link (the notification connects a new one, as a request would); an
// SHM READ copies without the peer and completes. warm: an echo came back before the stall
// (the peer's route back is open), else the peer's first answer comes after it. It returns
// the initiator.
func stalledPeerNotif(t *testing.T, peer *testPeer, cfg Config, warm bool) *Agent {
	t.Helper()
	ini, _, req := peerRead(t, peer, cfg, 4<<20, time.Minute)
	name := req.peer.name
	if warm {
		if err := postWait(t, req, []byte("before")); err != nil {
			t.Fatal(err)
		}
		if nt := recvNotif(t, ini); string(nt.Msg) != "ECHO:before" {
			t.Fatalf("echo %q, want ECHO:before", nt.Msg)
		}
	}
	stallRead(t, peer, req)
	if err := ini.SendNotif(testCtx(t), name, []byte("alone")); err != nil {
		t.Fatalf("SendNotif to the resumed peer: %v", err)
	}
	if nt := recvNotif(t, ini); string(nt.Msg) != "ECHO:alone" || nt.Peer != name {
		t.Fatalf("echo %+v, want ECHO:alone from %s", nt, name)
	}
	return ini
}

// TestStalledPeerNotif: once a stopped peer runs again, a notification sent alone reaches it
// and its echo comes back, over TCP (after a READ timed out and tore the connection down) and
// over SHM's Unix socket, whether or not the peer had answered before the stall.
func TestStalledPeerNotif(t *testing.T) {
	for _, be := range []string{"TCP", "SHM"} {
		for _, warm := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/warm=%v", be, warm), func(t *testing.T) {
				peer := startTestPeer(t, "xstallnotif", 5, 4<<20)
				stalledPeerNotif(t, peer, Config{Backends: []string{be}}, warm)
			})
		}
	}
}
