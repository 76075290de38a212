package pdbench

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/kvbridge/kvbridge/netns"
	"github.com/kvbridge/kvbridge/stats"
)

// tcpStream is the ceiling of a KV read across hosts: warm TCP connections from a reader on D's
// host to a sender on P's host, plain Go sockets with default buffers. Each round the reader
// asks for n bytes, spread evenly over the connections it uses (8 bytes each: the share), and
// the sender writes each share from memory in one call; the round lasts from the requests to
// the last byte read, like a READ.
type tcpStream struct {
	ln    net.Listener
	conns []net.Conn // the reader's ends
	bufs  [][]byte
	wg    sync.WaitGroup // the accept loop and one sender per connection
	once  sync.Once
}

// maxStream bounds one round's bytes.
const maxStream = 1 << 30

// newTCPStream listens on sender and makes conns connections from reader.
func newTCPStream(ctx context.Context, sender, reader *netns.Host, conns int) (*tcpStream, error) {
	ln, err := sender.Listen("tcp4", netip.AddrPortFrom(sender.Addr, 0).String())
	if err != nil {
		return nil, fmt.Errorf("pdbench: raw TCP stream: %w", err)
	}
	s := &tcpStream{ln: ln, bufs: make([][]byte, conns)}
	s.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return // the listener is closed
			}
			s.wg.Go(func() { serveStream(c) })
		}
	})
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for range conns {
		c, err := reader.DialContext(dctx, "tcp4", ln.Addr().String())
		if err != nil {
			s.Close()
			return nil, fmt.Errorf("pdbench: raw TCP stream: %w", err)
		}
		s.conns = append(s.conns, c)
	}
	return s, nil
}

// serveStream answers one connection's requests until the reader closes it.
func serveStream(c net.Conn) {
	defer c.Close()
	var data []byte
	var req [8]byte
	for {
		if _, err := io.ReadFull(c, req[:]); err != nil {
			return
		}
		n := binary.BigEndian.Uint64(req[:])
		if n > maxStream {
			return
		}
		if uint64(cap(data)) < n {
			data = make([]byte, n)
			for i := range data {
				data[i] = byte(i * 131) // not zeros: nothing on the path may compress them
			}
		}
		if _, err := c.Write(data[:n]); err != nil {
			return
		}
	}
}

// gbps runs one warm-up round and rounds more of n bytes over the first conns connections and
// returns the median rate.
func (s *tcpStream) gbps(ctx context.Context, n int64, conns, rounds int) (float64, error) {
	if n <= 0 || n > maxStream || conns < 1 || conns > len(s.conns) {
		return 0, fmt.Errorf("pdbench: raw TCP stream of %d bytes over %d connections", n, conns)
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		deadline = time.Now().Add(time.Minute)
	}
	shares := make([]int64, conns)
	for i := range shares {
		shares[i] = n / int64(conns)
		if i < int(n%int64(conns)) {
			shares[i]++
		}
		if int64(cap(s.bufs[i])) < shares[i] {
			s.bufs[i] = make([]byte, shares[i])
		}
		if err := s.conns[i].SetDeadline(deadline); err != nil {
			return 0, err
		}
	}
	var rates []float64
	errs := make([]error, conns)
	for r := range rounds + 1 {
		t0 := time.Now()
		var wg sync.WaitGroup
		for i := range conns {
			wg.Go(func() {
				var req [8]byte
				binary.BigEndian.PutUint64(req[:], uint64(shares[i]))
				if _, err := s.conns[i].Write(req[:]); err != nil {
					errs[i] = err
					return
				}
				_, errs[i] = io.ReadFull(s.conns[i], s.bufs[i][:shares[i]])
			})
		}
		wg.Wait()
		el := time.Since(t0)
		if err := errors.Join(errs...); err != nil {
			return 0, fmt.Errorf("pdbench: raw TCP stream: %w", err)
		}
		if r > 0 {
			rates = append(rates, float64(n)/el.Seconds()/1e9)
		}
	}
	return stats.Median(rates), nil
}

// Close closes the connections and the listener and waits for the senders. It is idempotent.
func (s *tcpStream) Close() error {
	s.once.Do(func() {
		for _, c := range s.conns {
			c.Close()
		}
		s.ln.Close()
		s.wg.Wait()
	})
	return nil
}
