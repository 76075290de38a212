package transfer_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/kvbridge/kvbridge/transfer"
)

// blockBytes is the size of one block in the examples: a paged KV pool's block.
const blockBytes = 4096

// node is an agent with one arena registered as one region.
type node struct {
	agent  *transfer.Agent
	arena  *transfer.Arena
	region *transfer.Region
}

// newNode starts agent name with an arena of blocks blocks, registered with perm for peers.
// Its TCP listener is on 127.0.0.1, on a free port.
func newNode(name string, blocks int, perm transfer.Perm) *node {
	a, err := transfer.NewAgent(name, transfer.Config{ListenTCP: "127.0.0.1:0"})
	if err != nil {
		log.Fatal(err)
	}
	ar, err := transfer.NewArena(name, int64(blocks)*blockBytes)
	if err != nil {
		log.Fatal(err)
	}
	r, err := a.Register(ar, 0, ar.Size(), perm)
	if err != nil {
		log.Fatal(err)
	}
	return &node{agent: a, arena: ar, region: r}
}

// close deregisters the region, closes the agent and then the arena.
func (n *node) close() {
	if err := n.agent.Deregister(n.region); err != nil {
		log.Fatal(err)
	}
	n.agent.Close()
	n.arena.Close()
}

// loaded starts a target and an initiator of blocks blocks each (the target's registered
// with perm for peers) and loads the target's metadata into the initiator. It returns the
// target's name as the initiator knows it and a function that closes both.
func loaded(target, initiator string, blocks int, perm transfer.Perm) (t, i *node, peer string, closeBoth func()) {
	t = newNode(target, blocks, perm)
	i = newNode(initiator, blocks, 0)
	peer, err := i.agent.LoadRemote(t.agent.LocalMetadata())
	if err != nil {
		log.Fatal(err)
	}
	return t, i, peer, func() { i.close(); t.close() }
}

// The NIXL workflow between two agents: the target registers memory peers may read; the
// initiator loads the target's metadata, prepares descriptor lists once, makes a request
// pairing descriptors by index, posts it with a notification and waits. The target learns
// that the data was read from the notification, which the engine sends only once the data
// has landed.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	// Register memory: the target's arena holds 8 blocks peers may read, the initiator's
	// 8 blocks it reads into.
	target := newNode("target", 8, transfer.PermRead)
	defer target.close()
	initiator := newNode("initiator", 8, 0)
	defer initiator.close()
	copy(target.region.Bytes()[2*blockBytes:], "the KV of block 2")

	// Load remote metadata. The blob travels over any side channel (kvbridge's connector
	// sends it in its handshake); LoadRemote returns the peer's name.
	peer, err := initiator.agent.LoadRemote(target.agent.LocalMetadata())
	if err != nil {
		log.Fatal(err)
	}

	// Prepare descriptor lists: validated once, the remote one bound to a backend (TCP
	// here; SHM when left to choose on one host) with its connections up.
	local, err := initiator.agent.PrepareLocal(transfer.BlockDescs(initiator.region.ID(), 0, blockBytes, 8))
	if err != nil {
		log.Fatal(err)
	}
	defer local.Release()
	remote, err := initiator.agent.PrepareRemote(ctx, peer, transfer.BlockDescs(target.region.ID(), 0, blockBytes, 8),
		&transfer.PrepareOptions{Backends: []string{"TCP"}})
	if err != nil {
		log.Fatal(err)
	}
	defer remote.Release()

	// Make a request: the target's blocks 2, 3 and 4 into the initiator's blocks 0, 1 and
	// 2. The pairs are contiguous on both sides, so they merge into one range.
	req, err := initiator.agent.MakeRequest(transfer.Read, local, []int{0, 1, 2}, remote, []int{2, 3, 4}, nil)
	if err != nil {
		log.Fatal(err)
	}
	defer req.Release()

	// Post, then wait. Post returns at once; the notification goes to the target when the
	// data is complete.
	if err := req.Post(ctx, []byte("read blocks 2-4")); err != nil {
		log.Fatal(err)
	}
	if err := req.Wait(ctx); err != nil {
		log.Fatal(err)
	}
	before, after := req.Descs()
	fmt.Printf("%v %s: %d bytes, %d descriptors merged into %d\n", req.Op(), req.Backend(), req.Bytes(), before, after)
	fmt.Printf("initiator's block 0: %q\n", initiator.region.Bytes()[:17])

	select {
	case n := <-target.agent.Notifications():
		fmt.Printf("target notified by %s: %s\n", n.Peer, n.Msg)
	case <-ctx.Done():
		log.Fatal("no notification")
	}
	// Output:
	// READ TCP: 12288 bytes, 3 descriptors merged into 1
	// initiator's block 0: "the KV of block 2"
	// target notified by initiator: read blocks 2-4
}

// A WRITE pushes local memory into a region the peer registered with PermWrite, here over
// SHM: the target's arena is mapped into the initiator's process and the engine copies.
// CreateRequest is the one-shot form: it prepares both lists itself and releases them with
// the request.
func ExampleAgent_CreateRequest() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	target, initiator, peer, closeBoth := loaded("write-target", "write-initiator", 4, transfer.PermWrite)
	defer closeBoth()
	copy(initiator.region.Bytes(), "pushed by the initiator")

	req, err := initiator.agent.CreateRequest(ctx, transfer.Write,
		[]transfer.Desc{initiator.region.Desc(0, blockBytes)}, peer, []transfer.Desc{target.region.Desc(3*blockBytes, blockBytes)},
		&transfer.RequestOptions{Backends: []string{"SHM"}, Timeout: 30 * time.Second})
	if err != nil {
		log.Fatal(err)
	}
	defer req.Release()
	if err := req.Post(ctx, nil); err != nil {
		log.Fatal(err)
	}
	if err := req.Wait(ctx); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%v %s: %d bytes\n", req.Op(), req.Backend(), req.Telemetry().Bytes)
	fmt.Printf("target's block 3: %q\n", target.region.Bytes()[3*blockBytes:3*blockBytes+23])
	// Output:
	// WRITE SHM: 4096 bytes
	// target's block 3: "pushed by the initiator"
}

// Notifications can also be sent on their own, for example to tell a producer that its
// blocks are no longer needed. Messages from one peer arrive in order.
func ExampleAgent_SendNotif() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	producer, consumer, peer, closeBoth := loaded("producer", "consumer", 1, transfer.PermRead)
	defer closeBoth()
	for _, msg := range []string{"done with request 1", "done with request 2"} {
		if err := consumer.agent.SendNotif(ctx, peer, []byte(msg)); err != nil {
			log.Fatal(err)
		}
	}
	for range 2 {
		select {
		case n := <-producer.agent.Notifications():
			fmt.Printf("%s #%d: %s\n", n.Peer, n.Seq, n.Msg)
		case <-ctx.Done():
			log.Fatal("no notification")
		}
	}
	// Output:
	// consumer #1: done with request 1
	// consumer #2: done with request 2
}
