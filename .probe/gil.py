exec(open('.probe/par.py').read().split('ref = bm.clone()')[0])
import threading
def loop(b, rr, dur, out):
    n = 0; end = time.perf_counter() + dur
    while time.perf_counter() < end:
        b.batch_fill_next_token_bitmask(ms[rr[0]:rr[-1]+1], bm, rr); n += 1
    out.append(n)
out = []; loop(ones[0], rows[:32], 1.0, out); print("one thread 32-row fills/s", out)
out = []
ths = [threading.Thread(target=loop, args=(ones[i], rows[i*32:(i+1)*32], 1.0, out)) for i in range(2)]
[t.start() for t in ths]; [t.join() for t in ths]; print("two threads", out)
