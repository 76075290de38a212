package transfer

import (
	"context"
	"testing"
)

// BenchmarkSHMPost measures one post + wait of a single-descriptor SHM READ in process (the
// per-request overhead of the engine on top of the copy). `kvbridge bench transfer` is the
// cross-process benchmark with ceilings.
func BenchmarkSHMPost(b *testing.B) {
	for _, size := range []int64{4 << 10, 64 << 10, 1 << 20} {
		b.Run(itoa(int(size>>10))+"KiB", func(b *testing.B) {
			must := func(err error) {
				if err != nil {
					b.Fatal(err)
				}
			}
			tgt, err := NewAgent("bench-target", Config{})
			must(err)
			defer tgt.Close()
			ini, err := NewAgent("bench-initiator", Config{})
			must(err)
			defer ini.Close()
			arT, err := NewArena("t", 4<<20)
			must(err)
			defer arT.Close()
			arI, err := NewArena("i", 4<<20)
			must(err)
			defer arI.Close()
			rt, err := tgt.Register(arT, 0, arT.Size(), PermReadWrite)
			must(err)
			defer tgt.Deregister(rt)
			ri, err := ini.Register(arI, 0, arI.Size(), 0)
			must(err)
			defer ini.Deregister(ri)
			_, err = ini.LoadRemote(tgt.LocalMetadata())
			must(err)
			ctx := context.Background()
			ll, err := ini.PrepareLocal([]Desc{ri.Desc(0, size)})
			must(err)
			defer ll.Release()
			rl, err := ini.PrepareRemote(ctx, "bench-target", []Desc{rt.Desc(0, size)}, nil)
			must(err)
			defer rl.Release()
			req, err := ini.MakeRequest(Read, ll, []int{0}, rl, []int{0}, nil)
			must(err)
			defer req.Release()
			b.SetBytes(size)
			b.ResetTimer()
			for range b.N {
				must(req.Post(ctx, nil))
				must(req.Wait(ctx))
			}
		})
	}
}
