// A program instrumented with @pyroscope/nodejs: burns CPU in a function with a known name and
// pushes its profiles to the server given on the command line.
//
// usage: node pyroscope_sdk_app.mjs SERVER_URL APP_NAME SECONDS
import Pyroscope from '@pyroscope/nodejs';

const [serverAddress, appName, seconds] = process.argv.slice(2);

function burnCpuInNodeFixture(until) {
  let total = 0;
  while (Date.now() < until) {
    for (let i = 0; i < 100000; i++) {
      total += Math.sqrt(i) * Math.sin(i);
    }
  }
  return total;
}

Pyroscope.init({
  serverAddress,
  appName,
  flushIntervalMs: 1000,
  tags: { region: 'test-west', sdk: 'nodejs' },
  wall: { collectCpuTime: true },
});
Pyroscope.start();
const until = Date.now() + Number(seconds) * 1000;
// Burn in slices so the SDK's flush timer gets to run in between.
while (Date.now() < until) {
  burnCpuInNodeFixture(Math.min(until, Date.now() + 200));
  await new Promise((resolve) => setImmediate(resolve));
}
// Stopping uploads what was sampled since the last upload.
await Pyroscope.stop();
