package kvevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/kvbridge/kvbridge/kvcache"
)

// recvTimeout bounds every wait for a message in these tests.
const recvTimeout = 20 * time.Second

// receiver delivers a socket's messages on a channel until the socket closes.
func receiver(s zmq4.Socket) <-chan zmq4.Msg {
	c := make(chan zmq4.Msg, 64)
	go func() {
		defer close(c)
		for {
			m, err := s.Recv()
			if err != nil {
				return
			}
			c <- m
		}
	}()
	return c
}

// next returns the next message of c, failing the test after recvTimeout.
func next(t *testing.T, c <-chan zmq4.Msg) zmq4.Msg {
	t.Helper()
	select {
	case m, ok := <-c:
		if !ok {
			t.Fatal("socket closed")
		}
		return m
	case <-time.After(recvTimeout):
		t.Fatal("no message within the deadline")
	}
	return zmq4.Msg{}
}

// storedEvent is the event of one block stored at the root with tokens [i, i, i, i].
func storedEvent(i int32) []kvcache.Event {
	tok := []int32{i, i, i, i}
	return []kvcache.Event{{Kind: kvcache.EventStored, Hash: kvcache.NextHash(kvcache.BlockHash{}, tok), Tokens: tok}}
}

// TestPublishAndReplay runs a publisher that connects to a subscriber that binds (vLLM's
// connect mode), on the topic "kv@", then asks its replay socket for the batches the
// subscriber missed while it was joining, and for the ones it saw.
func TestPublishAndReplay(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sub := zmq4.NewSub(ctx)
	defer sub.Close()
	if err := sub.SetOption(zmq4.OptionSubscribe, "kv@"); err != nil {
		t.Fatal(err)
	}
	if err := sub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	cfg, err := ParseConfig(fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "tcp://%s", "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv@", "buffer_steps": 1000}`, sub.Addr()))
	if err != nil {
		t.Fatal(err)
	}
	p, err := Start(Options{Config: cfg, Rank: 3, BlockSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	msgs := receiver(sub)

	// The subscription reaches the publisher some time after the connection: publish until
	// the first batch arrives (with a deadline), then three more that must all arrive in order.
	var first, published uint64
	deadline := time.Now().Add(recvTimeout)
	for joined := false; !joined; {
		if time.Now().After(deadline) {
			t.Fatal("no batch reached the subscriber")
		}
		p.PublishKVEvents(storedEvent(int32(published)))
		published++
		select {
		case m := <-msgs:
			first = checkMessage(t, m, "kv@")
			joined = true
		case <-time.After(50 * time.Millisecond): // a poll interval, not a wait for a result
		}
	}
	for i := range 3 {
		p.PublishKVEvents(storedEvent(int32(100 + i)))
	}
	total := published + 3
	// Every batch after the first one received arrives, in order (sequence numbers follow the
	// order of PublishKVEvents).
	for want := first + 1; want < total; want++ {
		if seq := checkMessage(t, next(t, msgs), "kv@"); seq != want {
			t.Fatalf("sequence %d, want %d", seq, want)
		}
	}

	// Replay from 0: every batch, in order, then the end marker.
	dealer := zmq4.NewDealer(ctx, zmq4.WithID(zmq4.SocketIdentity("replayer")))
	defer dealer.Close()
	if err := dealer.Dial("tcp://" + p.ReplayAddr().String()); err != nil {
		t.Fatal(err)
	}
	replies := receiver(dealer)
	for _, start := range []uint64{0, total - 2} {
		if err := dealer.Send(zmq4.NewMsgFrom([]byte{}, binary.BigEndian.AppendUint64(nil, start))); err != nil {
			t.Fatal(err)
		}
		var got []uint64
		for {
			m := next(t, replies)
			if len(m.Frames) != 3 || len(m.Frames[0]) != 0 {
				t.Fatalf("replay reply of %d frames, want [empty, seq, payload]", len(m.Frames))
			}
			if bytes.Equal(m.Frames[1], endSeq) {
				if len(m.Frames[2]) != 0 {
					t.Fatal("end marker with a payload")
				}
				break
			}
			if _, err := decodeWire(m.Frames[2]); err != nil {
				t.Fatalf("replayed batch: %v", err)
			}
			got = append(got, binary.BigEndian.Uint64(m.Frames[1]))
		}
		var want []uint64
		for s := start; s < total; s++ {
			want = append(want, s)
		}
		if !slices.Equal(got, want) {
			t.Fatalf("replay from %d: sequences %v, want %v", start, got, want)
		}
	}
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	p.PublishKVEvents(storedEvent(1)) // after Close: ignored, no panic
}

// checkMessage checks one published message (topic, 8-byte sequence, a batch of rank 3 holding
// one store) and returns its sequence number.
func checkMessage(t *testing.T, m zmq4.Msg, topic string) uint64 {
	t.Helper()
	if len(m.Frames) != 3 || string(m.Frames[0]) != topic || len(m.Frames[1]) != 8 {
		t.Fatalf("message of %d frames (%q), want [topic %q, 8-byte seq, payload]", len(m.Frames), m.Frames, topic)
	}
	w, err := decodeWire(m.Frames[2])
	if err != nil {
		t.Fatal(err)
	}
	if w.Rank == nil || *w.Rank != 3 || len(w.Events) != 1 || w.Events[0].Type != "BlockStored" {
		t.Fatalf("batch %+v, want one BlockStored of rank 3", w)
	}
	return binary.BigEndian.Uint64(m.Frames[1])
}

// TestQueueDropsOldest: with max_queue_size batches waiting, a new batch drops the oldest and
// counts it. The goroutine is not started, so nothing drains the queue.
func TestQueueDropsOldest(t *testing.T) {
	p := &Publisher{opts: Options{Config: Config{MaxQueueSize: 2}}, wake: make(chan struct{}, 1)}
	for i := range 3 {
		p.PublishKVEvents(storedEvent(int32(i)))
	}
	p.PublishKVEvents(nil) // nothing to send: not queued
	if p.Dropped() != 1 || len(p.queue) != 2 || p.queue[0].events[0].Tokens[0] != 1 || p.queue[1].events[0].Tokens[0] != 2 {
		t.Fatalf("dropped %d, queue of %d: want the oldest of 3 dropped", p.Dropped(), len(p.queue))
	}
}

// TestBindIPC binds the PUB socket on an ipc endpoint (vLLM binds ipc://) and serves a
// subscriber that connects.
func TestBindIPC(t *testing.T) {
	path := t.TempDir() + "/kv.sock"
	cfg, err := ParseConfig(`{"enable_kv_cache_events": true, "endpoint": "ipc://` + path + `"}`)
	if err != nil {
		t.Fatal(err)
	}
	p, err := Start(Options{Config: cfg, BlockSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if p.ReplayAddr() != nil {
		t.Fatal("replay socket without replay_endpoint")
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sub := zmq4.NewSub(ctx)
	defer sub.Close()
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		t.Fatal(err)
	}
	if err := sub.Dial("ipc://" + path); err != nil {
		t.Fatal(err)
	}
	msgs := receiver(sub)
	deadline := time.Now().Add(recvTimeout)
	for {
		if time.Now().After(deadline) {
			t.Fatal("no batch reached the subscriber")
		}
		p.PublishKVEvents(storedEvent(7))
		select {
		case m := <-msgs:
			if len(m.Frames) != 3 || len(m.Frames[0]) != 0 {
				t.Fatalf("message %q, want an empty topic frame", m.Frames)
			}
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// TestParseConfig covers vLLM's defaults and every refusal.
func TestParseConfig(t *testing.T) {
	c, err := ParseConfig(`{"enable_kv_cache_events": true}`)
	if err != nil {
		t.Fatal(err)
	}
	want := Config{Enabled: true, Publisher: "zmq", Endpoint: "tcp://*:5557", BufferSteps: 10000, HWM: 100000, MaxQueueSize: 100000}
	if c != want || !c.Active() {
		t.Fatalf("defaults %+v, want %+v", c, want)
	}
	if c, err := ParseConfig(`{"publisher": "zmq", "replay_endpoint": null}`); err != nil || c.Active() {
		t.Fatalf("disabled zmq: %+v %v, want parsed and inactive", c, err)
	}
	if c, err := ParseConfig(`{}`); err != nil || c.Publisher != "null" {
		t.Fatalf("empty: %+v %v, want the null publisher", c, err)
	}
	for in, wantErr := range map[string]string{
		`{"enable_kv_cache_events": true, "endpont": "x"}`:                     `unknown key "endpont"`,
		`{"enable_kv_cache_events": true, "publisher": "kafka"}`:               `publisher "kafka"`,
		`{"enable_kv_cache_events": "yes"}`:                                    "enable_kv_cache_events",
		`{"enable_kv_cache_events": true, "hwm": -1}`:                          "hwm -1",
		`{"enable_kv_cache_events": true, "max_queue_size": 0}`:                "max_queue_size 0",
		`{"enable_kv_cache_events": true, "buffer_steps": 1.5}`:                "buffer_steps",
		`{"enable_kv_cache_events": true, "endpoint": "udp://x"}`:              "endpoint",
		`{"enable_kv_cache_events": true, "endpoint": null}`:                   "endpoint must not be null",
		`{"enable_kv_cache_events": true, "replay_endpoint": "tcp://h:99999"}`: "replay_endpoint",
		`[1]`:  "JSON object",
		`null`: "JSON object",
	} {
		if _, err := ParseConfig(in); err == nil || !strings.Contains(err.Error(), wantErr) {
			t.Errorf("ParseConfig(%s) = %v, want an error containing %q", in, err, wantErr)
		}
	}
}

// TestForRank offsets ports as vLLM's offset_endpoint_port.
func TestForRank(t *testing.T) {
	c := Config{Endpoint: "tcp://*:5557", ReplayEndpoint: "tcp://[::1]:5600"}.ForRank(2)
	if c.Endpoint != "tcp://*:5559" || c.ReplayEndpoint != "tcp://[::1]:5602" {
		t.Fatalf("rank 2: %+v", c)
	}
	if c := (Config{Endpoint: "ipc:///tmp/kv"}).ForRank(1); c.Endpoint != "ipc:///tmp/kv_dp1" || c.ReplayEndpoint != "" {
		t.Fatalf("ipc rank 1: %+v", c)
	}
	if c := (Config{Endpoint: "tcp://127.0.0.1:0"}).ForRank(1); c.Endpoint != "tcp://127.0.0.1:0" {
		t.Fatalf("port 0 rank 1: %+v", c)
	}
	if c := (Config{Endpoint: "tcp://*:5557"}).ForRank(0); c.Endpoint != "tcp://*:5557" {
		t.Fatalf("rank 0: %+v", c)
	}
}

// TestStartFails: a replay endpoint in use fails Start and leaves nothing running.
func TestStartFails(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	cfg, err := ParseConfig(fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "ipc://%s/kv", "replay_endpoint": "tcp://%s"}`, t.TempDir(), ln.Addr()))
	if err != nil {
		t.Fatal(err)
	}
	if p, err := Start(Options{Config: cfg}); err == nil {
		p.Close()
		t.Fatal("Start succeeded on a replay port in use")
	}
	if _, err := Start(Options{Config: Config{}}); err == nil {
		t.Fatal("Start succeeded on an inactive config")
	}
}

// TestConnectBeforeSubscriber: in connect mode the publisher starts while no subscriber
// listens (as a ZeroMQ connect, it does not wait), reaches the subscriber once it binds, and a
// Close during a dial returns.
func TestConnectBeforeSubscriber(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The subscriber binds a port found free and released before the publisher starts; another
	// process may take it in between, so a failed bind starts over on a new port.
	var p *Publisher
	var sub zmq4.Socket
	var err error
	for attempt := 0; ; attempt++ {
		p, sub, err = startBeforeSubscriber(t, ctx)
		if err == nil {
			break
		}
		if attempt == 4 {
			t.Fatalf("listen on a freed port, 5 times: %v", err)
		}
	}
	defer p.Close()
	defer sub.Close()
	msgs := receiver(sub)
	deadline := time.Now().Add(recvTimeout)
	for {
		if time.Now().After(deadline) {
			t.Fatal("no batch reached the subscriber that bound late")
		}
		p.PublishKVEvents(storedEvent(7))
		select {
		case m := <-msgs:
			if len(m.Frames) != 3 {
				t.Fatalf("message %q", m.Frames)
			}
			return
		case <-time.After(50 * time.Millisecond): // a poll interval
		}
	}
}

// startBeforeSubscriber starts a publisher in connect mode towards a free port nobody listens
// on, publishes once (dropped: no subscriber yet, and it must not block), starts and closes a
// second publisher while it still dials nobody, and then binds a subscriber on that port.
func startBeforeSubscriber(t *testing.T, ctx context.Context) (*Publisher, zmq4.Socket, error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close() // free: the subscriber binds it below
	cfg, err := ParseConfig(`{"enable_kv_cache_events": true, "endpoint": "tcp://` + addr + `"}`)
	if err != nil {
		t.Fatal(err)
	}
	p, err := Start(Options{Config: cfg, BlockSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	p.PublishKVEvents(storedEvent(1))

	p2, err := Start(Options{Config: cfg, BlockSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	if err := p2.Close(); err != nil {
		t.Fatal(err)
	}

	sub := zmq4.NewSub(ctx)
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		t.Fatal(err)
	}
	if err := sub.Listen("tcp://" + addr); err != nil {
		sub.Close()
		p.Close()
		return nil, nil, fmt.Errorf("%s: %w", addr, err)
	}
	return p, sub, nil
}

// TestReplayRefusesBadRequests: a malformed replay request (wrong frames, a sequence number
// longer than 8 bytes) gets no answer and does not end the connection; the next good one is
// answered. A connection that sends garbage instead of ZMTP is dropped without harm.
func TestReplayRefusesBadRequests(t *testing.T) {
	cfg, err := ParseConfig(fmt.Sprintf(`{"enable_kv_cache_events": true, "endpoint": "ipc://%s/kv", "replay_endpoint": "tcp://127.0.0.1:0", "buffer_steps": 2}`, t.TempDir()))
	if err != nil {
		t.Fatal(err)
	}
	p, err := Start(Options{Config: cfg, BlockSize: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	for i := range 3 {
		p.PublishKVEvents(storedEvent(int32(i)))
	}
	// Sent counts a batch once it is kept and sent: wait for all three (with a deadline).
	for deadline := time.Now().Add(recvTimeout); p.Sent() < 3; runtime.Gosched() {
		if time.Now().After(deadline) {
			t.Fatalf("%d of 3 batches sent", p.Sent())
		}
	}
	raw, err := net.Dial("tcp", p.ReplayAddr().String())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := raw.Write([]byte("GET / HTTP/1.1\r\n\r\n")); err != nil {
		t.Fatal(err)
	}
	raw.Close()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dealer := zmq4.NewDealer(ctx, zmq4.WithID(zmq4.SocketIdentity("r")))
	defer dealer.Close()
	if err := dealer.Dial("tcp://" + p.ReplayAddr().String()); err != nil {
		t.Fatal(err)
	}
	replies := receiver(dealer)
	for _, bad := range []zmq4.Msg{
		zmq4.NewMsgFrom([]byte{}, make([]byte, 9)),
		zmq4.NewMsgFrom(make([]byte, 8)),
		zmq4.NewMsgFrom([]byte("x"), make([]byte, 8)),
	} {
		if err := dealer.Send(bad); err != nil {
			t.Fatal(err)
		}
	}
	if err := dealer.Send(zmq4.NewMsgFrom([]byte{}, []byte{0})); err != nil { // a 1-byte start: 0
		t.Fatal(err)
	}
	// buffer_steps 2: batches 1 and 2 are kept, then the end marker.
	var got []uint64
	for {
		m := next(t, replies)
		if bytes.Equal(m.Frames[1], endSeq) {
			break
		}
		got = append(got, binary.BigEndian.Uint64(m.Frames[1]))
	}
	if !slices.Equal(got, []uint64{1, 2}) {
		t.Fatalf("replayed %v, want the last 2 of 3 batches, 1 and 2", got)
	}
}
